"""Assembly of a serving process: engine, scheduler thread, servicers, lifecycle.

server = LaneServer(load_engine(config), config)   # slow: loads and probes the model
port = await server.start()                        # listening, health SERVING
...
await server.stop()                                # drains, answers everything, stops
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from laneserve.server.clock import Clock, SystemClock
from laneserve.server.config import ServerConfig
from laneserve.server.cost_model import RunTimeModel
from laneserve.server.engine import Engine
from laneserve.server.errors import DrainingError
from laneserve.server.events import FanOut, SchedulerEvents
from laneserve.server.lifecycle import Lifecycle
from laneserve.server.scheduler import Scheduler
from laneserve.server.scheduler_thread import SchedulerThread
from laneserve.server.service import InferenceServicer, OutcomeRouter
from laneserve.server.stats import StatsRecorder
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name


def load_engine(config: ServerConfig) -> Engine:
    return Engine(config.model_path, device=config.device, intra_op_threads=config.intra_op_threads)


class LaneServer:
    """One model served over gRPC. Create and start it inside the event loop it serves on."""

    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        *,
        events: SchedulerEvents | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.clock = clock or SystemClock()
        self.state = Lifecycle.STARTING
        self.batch_cap = config.max_batch_size
        probe = engine.probe(self.batch_cap)
        log.info(
            "probe: run time by batch size %s",
            {rows: f"{seconds * 1000:.2f}ms" for rows, seconds in probe.items()},
        )
        self.stats = StatsRecorder([lane.name for lane in config.lanes])
        self.scheduler = Scheduler(
            config.lanes,
            batch_cap=self.batch_cap,
            run_time=RunTimeModel(probe),
            events=self.stats if events is None else FanOut(self.stats, events),
        )
        self._health = health.aio.HealthServicer()
        self._thread: SchedulerThread | None = None
        self._server: grpc.aio.Server | None = None
        self._stopped = asyncio.Event()
        self.port = 0

    async def start(self) -> int:
        """Binds, starts the threads and serves; returns the bound port."""
        assert self.state is Lifecycle.STARTING
        router = OutcomeRouter(asyncio.get_running_loop())
        self._thread = SchedulerThread(
            self.scheduler, self.engine.run_batch, router.deliver, clock=self.clock
        )
        limit = self.config.max_message_bytes
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
            ]
        )
        pb_grpc.add_InferenceServiceServicer_to_server(
            InferenceServicer(
                self.config,
                self.engine,
                self._thread,
                self.stats,
                state=lambda: self.state,
                clock=self.clock,
                started_s=self.clock.monotonic(),
            ),
            server,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        self.port = server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        if self.port == 0:
            raise OSError(f"cannot bind {self.config.host}:{self.config.port}")
        self._thread.start()
        await server.start()
        self._server = server
        self.state = Lifecycle.SERVING
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "serving %s on %s:%d providers=%s batch_cap=%d lanes=%s",
            self.config.model_path,
            self.config.host,
            self.port,
            self.engine.providers,
            self.batch_cap,
            [lane.name for lane in self.config.lanes],
        )
        return self.port

    async def stop(self, grace_s: float | None = None) -> None:
        """Drains: refuses new work, lets queued work finish within the grace period,
        answers the rest UNAVAILABLE, then stops listening. Safe to call twice."""
        if self.state in (Lifecycle.DRAINING, Lifecycle.STOPPED):
            await self._stopped.wait()
            return
        self.state = Lifecycle.DRAINING
        grace_s = self.config.drain_grace_s if grace_s is None else grace_s
        await self._health.enter_graceful_shutdown()
        assert self._thread is not None
        assert self._server is not None
        self._thread.stop_accepting()
        drained = await asyncio.to_thread(self._thread.wait_drained, grace_s)
        if not drained:
            log.warning("drain grace of %.1fs ran out; answering what is left UNAVAILABLE", grace_s)
        await asyncio.to_thread(
            self._thread.close, DrainingError("server shut down before this request could run")
        )
        # Every RPC now has its answer; give them a moment to be written.
        await self._server.stop(grace=2.0)
        self.state = Lifecycle.STOPPED
        self._stopped.set()
        log.info("stopped")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()
