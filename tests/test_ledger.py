"""The books balance: after traffic that ends every way a request can end, GetStats says
what each caller was told, Prometheus says what GetStats says, and nothing is left held.

Each test drives one server through a fixed mix (the engine held while work queues, so
what is queued beside what is known), then compares the server's counts with the
outcomes its callers saw, outcome by outcome, and with the invariants DESIGN.md states.
The counts are exact: a count that moves when a code path changes is what this file is
for."""

from __future__ import annotations

import asyncio
import collections
import urllib.request
from collections.abc import Awaitable, Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from laneserve.server import LaneConfig, ServerConfig, idempotency
from laneserve.server.errors import EngineError
from laneserve.server.idempotency import _size_bytes
from laneserve.server.items import Array
from laneserve.server.memory import parse_memory_limit
from laneserve.server.stats import StatsSnapshot
from laneserve.v1 import inference_pb2 as pb
from tests.support import (
    RecordingEngine,
    Serving,
    flight_waiters,
    item_reason,
    queued_rows,
    request,
    rich_status,
    rows,
    serving,
    until,
    until_stats,
)

# Long default deadlines: nothing expires but what a test gives a short one.
LANES = (
    LaneConfig("interactive", capacity_rows=64, timeout_ms=60_000, max_wait_ms=1, min_share=0.0),
    LaneConfig("standard", capacity_rows=512, timeout_ms=60_000, max_wait_ms=2, min_share=0.1),
    LaneConfig("bulk", capacity_rows=4096, timeout_ms=60_000, max_wait_ms=5, min_share=0.05),
)
# The demo model ran 512 rows in a 32 MiB arena and ran out of memory at 544 (engine.py):
# a full batch of 1 024 rows is split for real.
ARENA = "32MiB"
CAP = 1024
# The deadline of the requests that expire in the queue: met, were the session not held
# (a shorter one can be refused DEADLINE_UNMEETABLE on a loaded machine).
EXPIRES_MS = 400
RECEIVE_LIMIT = (("laneserve-max-receive-bytes", "1024"),)  # 25 rows' answer is over it


class Tally:
    """What the callers were told, by lane and outcome: "OK" or the ErrorInfo reason
    ("" for gRPC's own DEADLINE_EXCEEDED and CANCELLED, which carry none)."""

    def __init__(self) -> None:
        self.seen: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )

    async def unary(self, lane: str, call: Awaitable[pb.InferResponse]) -> str:
        try:
            await call
            outcome = "OK"
        except asyncio.CancelledError:
            outcome = "LEFT"
        except grpc.aio.AioRpcError as error:
            outcome = rich_status(error)[0] or error.code().name
        self.seen[lane][outcome] += 1
        return outcome

    def item(self, lane: str, answer: pb.InferStreamResponse) -> None:
        self.seen[lane]["OK" if not answer.HasField("error") else item_reason(answer)] += 1


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def by_label(
    metrics: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, key: str, lane: str
) -> dict[str, int]:
    """The non-zero samples of `name` for `lane`, by the value of label `key`."""
    found: dict[str, int] = {}
    for (sample, labels), value in metrics.items():
        label = dict(labels)
        if sample == name and label.get("lane") == lane and value:
            found[label[key]] = found.get(label[key], 0) + int(value)
    return found


def total(metrics: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str) -> float:
    return sum(value for (sample, _), value in metrics.items() if sample == name)


def imbalances(stats: pb.GetStatsResponse) -> Iterator[str]:
    """The invariants GetStats states for idle lanes (inference.proto, LaneStats)."""
    for lane in stats.lanes:
        answered = dict(lane.answered)
        if lane.admitted != sum(answered.values()):
            yield f"{lane.name}: admitted {lane.admitted}, answered {answered}"
        ends = (
            lane.completed
            + lane.failed
            + answered.get("EXPIRED_IN_QUEUE", 0)
            + answered.get("CANCELLED", 0)
        )
        if lane.admitted != ends:
            yield f"{lane.name}: admitted {lane.admitted} != completed+failed+shed ends {ends}"
        if lane.completed != answered.get("OK", 0):
            yield f"{lane.name}: completed {lane.completed}, answered OK {answered.get('OK')}"
        for reason, count in lane.shed.items():
            if count > answered.get(reason, 0):
                yield f"{lane.name}: shed {reason} {count} > answered {answered.get(reason)}"
        if lane.depth_rows or lane.depth_requests:
            yield f"{lane.name}: {lane.depth_rows} rows queued once idle"
    if sum(stats.batch_reasons.values()) != stats.batches:
        yield f"batch reasons {dict(stats.batch_reasons)} do not add up to {stats.batches}"


def disagreements(
    stats: pb.GetStatsResponse, metrics: dict[tuple[str, frozenset[tuple[str, str]]], float]
) -> Iterator[str]:
    """Where the Prometheus endpoint says other than GetStats."""
    for lane in stats.lanes:
        admitted = by_label(metrics, "laneserve_requests_admitted_total", "lane", lane.name)
        if sum(admitted.values()) != lane.admitted:
            yield f"{lane.name}: admitted {admitted} in Prometheus, {lane.admitted} in GetStats"
        for name, key, counts in (
            ("laneserve_requests_rejected_total", "reason", lane.rejected),
            ("laneserve_requests_shed_total", "reason", lane.shed),
            ("laneserve_requests_completed_total", "status", lane.answered),
        ):
            prometheus = by_label(metrics, name, key, lane.name)
            if prometheus != {k: v for k, v in counts.items() if v}:
                yield f"{lane.name}: {name} {prometheus}, GetStats {dict(counts)}"
        durations = by_label(metrics, "laneserve_request_duration_seconds_count", "lane", lane.name)
        if sum(durations.values()) != sum(lane.answered.values()):
            yield f"{lane.name}: {durations} request durations, {dict(lane.answered)} answered"
    batches = (
        total(metrics, "laneserve_batches_total"),
        total(metrics, "laneserve_batch_size_count"),
        total(metrics, "laneserve_infer_duration_seconds_count"),
    )
    if batches != (stats.batches,) * 3:
        yield f"batches, batch sizes, run times {batches} in Prometheus; {stats.batches} ran"
    for name, value in (
        ("laneserve_device_out_of_memory_total", stats.out_of_memory_events),
        ("laneserve_batch_splits_total", stats.batch_splits),
        ("laneserve_replay_cache_entries", stats.replay_cache_entries),
        ("laneserve_replay_cache_size_bytes", stats.replay_cache_bytes),
    ):
        if total(metrics, name) != value:
            yield f"{name} {total(metrics, name)} in Prometheus, {value} in GetStats"


def lane_counts(stats: pb.GetStatsResponse | StatsSnapshot) -> dict[str, dict[str, Any]]:
    return {
        lane.name: {
            "answered": {k: v for k, v in dict(lane.answered).items() if v},
            "rejected": {k: v for k, v in dict(lane.rejected).items() if v},
            "shed": {k: v for k, v in dict(lane.shed).items() if v},
        }
        for lane in stats.lanes
    }


class FailsOnTag(RecordingEngine):
    """The real session in a 32 MiB arena, failing as the runtime would any run that
    holds the row tagged `bad` (fault injection): the batch is split to find it.
    `answered_tags`: the rows of the runs that succeeded."""

    def __init__(self, model: Path, bad: int) -> None:
        super().__init__(str(model), device="cpu", memory_limit=parse_memory_limit(ARENA))
        self.bad = bad
        self.answered_tags: list[int] = []

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        tags = [int(tag) for tag in inputs["input"][:, 0]]
        if self.bad in tags:
            raise EngineError(f"injected: the model failed on row {tags.index(self.bad)}")
        outputs = super().run(inputs)
        self.answered_tags += tags
        return outputs


def config(model: Path) -> ServerConfig:
    return ServerConfig(
        model_path=str(model), lanes=LANES, metrics_port=0, max_batch_size=CAP, batch_cap=CAP
    )


class Mix:
    """Calls to one server, each told to `tally`; `queued`: the rows they queued."""

    def __init__(self, s: Serving, tally: Tally) -> None:
        self.s = s
        self.tally = tally
        self.calls: list[asyncio.Future[str]] = []
        self.queued = 0

    def call(self, lane: str, body: pb.InferRequest, **options: Any) -> Any:
        """Starts a unary call (its outcome tallied in `calls`); returns it, to cancel."""
        started = self.s.stub.Infer(body, **options)
        self.calls.append(asyncio.ensure_future(self.tally.unary(lane, started)))
        return started

    async def queue(self, lane: str, count: int, start: int, **fields: Any) -> pb.InferRequest:
        """Queues a request of `count` rows tagged from `start`, behind the held batch."""
        body = request(rows(count, start=start), lane=lane, **fields)
        self.call(lane, body)
        self.queued += count
        await until(lambda: queued_rows(self.s) == self.queued)
        return body

    async def refused(self, lane: str, body: pb.InferRequest) -> str:
        outcome = await self.tally.unary(lane, self.s.stub.Infer(body))
        assert outcome != "OK"
        return outcome

    async def shed(self, lane: int, reason: str, count: int = 1) -> None:
        await until_stats(self.s, lambda stats: stats.lanes[lane].shed[reason] == count)

    async def outcomes(self) -> set[str]:
        return {await done for done in self.calls}


async def every_end(mix: Mix, bad_tag: int) -> None:
    """While the first batch is held: one request queued, refused or shed each way."""
    await mix.queue("interactive", 40, 100)
    await mix.refused("interactive", request(rows(40, start=200), lane="interactive"))
    joined = await mix.queue("standard", 4, 300, request_id="joined")
    reused = request(rows(4, start=310), lane="standard", request_id="joined")
    await mix.refused("standard", reused)
    for _ in range(idempotency.MAX_CALLERS_WAITING + 1):  # 4 join; 2 are refused
        mix.call("standard", joined)
    await until_stats(
        mix.s, lambda stats: sum(lane.rejected["JOIN_LIMIT"] for lane in stats.lanes) == 2
    )
    await mix.queue("standard", 4, bad_tag - 1)  # the bad row is its second
    mix.call("standard", request(rows(2, start=3200), lane="standard", timeout_ms=EXPIRES_MS))
    await mix.shed(1, "EXPIRED_IN_QUEUE")
    leaving = mix.call("bulk", request(rows(3, start=3300), lane="bulk"))
    await until(lambda: queued_rows(mix.s) == mix.queued + 3)
    leaving.cancel()
    await mix.shed(2, "CANCELLED")


async def stream_items(mix: Mix) -> Any:
    """A stream whose caller reads at most 1 KiB: one item answered, one expires while
    queued, one's answer is over the limit. Returns the call, to read once released."""
    items = [
        request(rows(1, start=3400), lane="bulk", request_id="item-0"),
        request(rows(1, start=3401), lane="bulk", request_id="item-1", timeout_ms=EXPIRES_MS),
        request(rows(30, start=3410), lane="bulk", request_id="item-2"),
    ]
    stream = mix.s.stub.InferStream(iter(items), metadata=RECEIVE_LIMIT)
    # Item 1 ends (shed, expired), however it ends: the counts at the end say how.
    await until_stats(mix.s, lambda stats: ended(stats.lanes[2]) == 2)  # and the one that left
    mix.queued += 1 + 30
    await until(lambda: queued_rows(mix.s) == mix.queued)
    return stream


def ended(lane: pb.LaneStats) -> int:
    """Requests of `lane` that were answered or refused."""
    return sum(lane.answered.values()) + sum(lane.rejected.values())


def books(stats: pb.GetStatsResponse, s: Serving, metrics: Any) -> list[str]:
    """Every way the server's counts disagree with each other or with what it holds."""
    problems = [*imbalances(stats), *disagreements(stats, metrics)]
    servicer = s.server._servicer
    assert servicer is not None
    ledger = servicer._ledger
    entries = ledger.replay._entries
    held = (len(entries), sum(_size_bytes(key, value) for key, value in entries.items()))
    if held != (stats.replay_cache_entries, stats.replay_cache_bytes):
        problems.append(f"the replay cache holds {held}, GetStats says otherwise")
    if ledger._flights:
        problems.append(f"requests still in flight: {sorted(ledger._flights)}")
    return problems


def test_every_end_a_request_can_have_is_counted_once_and_alike_everywhere(
    demo_model: Path,
) -> None:
    """One of each: answered OK after a real out-of-memory split; refused LANE_FULL,
    REQUEST_ID_REUSED, JOIN_LIMIT, DEADLINE_UNMEETABLE; shed EXPIRED_IN_QUEUE (a unary
    request and a stream item) and CANCELLED; ENGINE_FAILURE for one bad request whose
    batch was split to isolate it; ANSWER_TOO_LARGE for a caller that reads less; gRPC's
    DEADLINE_EXCEEDED while the batch ran; joins and a replay. Then GetStats' refusals
    and ends are what the callers were told, Prometheus agrees with GetStats, and the
    replay cache and the ledger of requests in flight hold what they say."""
    tally = Tally()
    bad_tag = 7_000

    async def scenario() -> tuple[pb.GetStatsResponse, list[str]]:
        engine = FailsOnTag(demo_model, bad_tag)
        async with serving(engine, config(demo_model)) as s:
            mix = Mix(s, tally)
            engine.hold_next()
            mix.call("interactive", request(rows(1, start=0), lane="interactive"))
            assert await asyncio.to_thread(engine.entered.acquire, True, 30)
            await every_end(mix, bad_tag)
            stream = await stream_items(mix)
            # With the rest queued, a batch of 1 024 rows: out of memory, split.
            await mix.queue("bulk", 2000, 1000)
            await mix.refused("bulk", request(rows(1, start=3100), lane="bulk", timeout_ms=1))
            engine.release()
            for answer in [answer async for answer in stream]:
                tally.item("bulk", answer)
            assert await mix.outcomes() >= {"OK", "LEFT", "ENGINE_FAILURE"}

            # gRPC's deadline passes while the request's batch runs (with an id, the work
            # runs on after its caller goes, for a retry's replay).
            engine.hold_next()
            late_body = request(rows(1, start=3500), lane="standard", request_id="late")
            late = s.stub.Infer(late_body, timeout=1.0)
            assert await asyncio.to_thread(engine.entered.acquire, True, 30)
            assert await tally.unary("standard", late) == "DEADLINE_EXCEEDED"
            # Its cancel reaches the server before the answer does: released sooner, the
            # answer could come first on a loaded loop, while the server's copy of the
            # deadline (from the call's arrival) was still ahead, and count OK (one run
            # in eight under load).
            await until(lambda: flight_waiters(s, "late") == 0)
            engine.release()
            await until_stats(s, lambda stats: stats.lanes[1].answered["DEADLINE_EXCEEDED"] == 1)
            joined = request(rows(4, start=300), lane="standard", request_id="joined")
            assert await tally.unary("standard", s.stub.Infer(joined)) == "OK", "a replay"

            stats = await s.stub.GetStats(pb.GetStatsRequest())
            assert s.server.metrics_port is not None
            metrics = await asyncio.to_thread(scrape, s.server.metrics_port)
            assert bad_tag not in engine.answered_tags
            assert bad_tag - 1 in engine.answered_tags, "its neighbour in the request ran"
            return stats, books(stats, s, metrics)

    stats, problems = asyncio.run(scenario())
    assert problems == []
    assert stats.out_of_memory_events >= 1
    assert stats.batch_splits >= 1
    assert (stats.idempotent_joins, stats.idempotent_replays) == (4, 1)
    assert lane_counts(stats) == {
        "interactive": {"answered": {"OK": 2}, "rejected": {"LANE_FULL": 1}, "shed": {}},
        "standard": {
            "answered": {
                "OK": 1,
                "ENGINE_FAILURE": 1,
                "EXPIRED_IN_QUEUE": 1,
                "DEADLINE_EXCEEDED": 1,
            },
            "rejected": {"REQUEST_ID_REUSED": 1, "JOIN_LIMIT": 2},
            "shed": {"EXPIRED_IN_QUEUE": 1},
        },
        "bulk": {
            "answered": {"OK": 2, "CANCELLED": 1, "EXPIRED_IN_QUEUE": 1, "ANSWER_TOO_LARGE": 1},
            "rejected": {"DEADLINE_UNMEETABLE": 1},
            "shed": {"CANCELLED": 1, "EXPIRED_IN_QUEUE": 1},
        },
    }
    # What the callers were told: the server's ends and refusals, one joined request's
    # callers each told its answer (1 + 4 joins + 1 replay), gRPC's own ends unlabelled.
    assert {lane: dict(seen) for lane, seen in tally.seen.items()} == {
        "interactive": {"OK": 2, "LANE_FULL": 1},
        "standard": {
            "OK": 1 + 4 + 1,
            "REQUEST_ID_REUSED": 1,
            "JOIN_LIMIT": 2,
            "ENGINE_FAILURE": 1,
            "EXPIRED_IN_QUEUE": 1,
            "DEADLINE_EXCEEDED": 1,
        },
        "bulk": {
            "OK": 2,
            "DEADLINE_UNMEETABLE": 1,
            "LEFT": 1,
            "EXPIRED_IN_QUEUE": 1,
            "ANSWER_TOO_LARGE": 1,
        },
    }


def test_a_drain_counts_what_it_refused_and_what_it_ended(small_model: Path) -> None:
    """A drain with a batch running and work queued in every lane: a call that came
    during it is refused DRAINING, the queued work ends DRAINING when the grace ends, the
    batch still running when it ends too (its caller is answered now, not when it ends).
    Every admitted request ends once, as its caller was told."""
    tally = Tally()

    async def scenario() -> tuple[StatsSnapshot, Any]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            mix = Mix(s, tally)
            engine.hold_next()
            mix.call("standard", request(rows(1, start=0), lane="standard"))
            assert await asyncio.to_thread(engine.entered.acquire, True, 30)
            await mix.queue("interactive", 1, 10)
            await mix.queue("standard", 2, 20, request_id="queued")
            await mix.queue("bulk", 3, 30)
            stopping = asyncio.ensure_future(s.server.stop(grace_s=60))
            await until_stats(s, lambda stats: stats.state == "DRAINING")
            await mix.refused("bulk", request(rows(1, start=40), lane="bulk"))
            s.server.end_grace()
            await until(lambda: queued_rows(s) == 0)
            engine.release()
            await stopping
            outcomes = await mix.outcomes()
            return s.server.stats.snapshot(), outcomes

    snapshot, outcomes = asyncio.run(scenario())
    assert outcomes == {"DRAINING"}
    for lane in snapshot.lanes:
        assert lane.admitted == sum(lane.answered.values()) == lane.completed + lane.failed
    assert lane_counts(snapshot) == {
        "interactive": {"answered": {"DRAINING": 1}, "rejected": {}, "shed": {}},
        "standard": {"answered": {"DRAINING": 2}, "rejected": {}, "shed": {}},
        "bulk": {"answered": {"DRAINING": 1}, "rejected": {"DRAINING": 1}, "shed": {}},
    }
    assert {lane: dict(seen) for lane, seen in tally.seen.items()} == {
        "interactive": {"DRAINING": 1},
        "standard": {"DRAINING": 2},
        "bulk": {"DRAINING": 2},
    }
