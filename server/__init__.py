"""laneserve server: one ONNX model, bounded priority lanes, one batching scheduler.

The request path, module by module: config -> lanes -> scheduler (policy) ->
scheduler_thread (threads) -> engine (the session) -> service (gRPC), with errors,
codec, memory (budget, watermark), idempotency and events/stats beside them;
telemetry/ turns events into traces, metrics and logs; app assembles a serving
process, cli runs it, process tunes the interpreter for it (GIL switching, GC).
"""

from laneserve.server.app import LaneServer, load_engine
from laneserve.server.clock import Clock, ManualClock, SystemClock
from laneserve.server.config import ConfigError, LaneConfig, ServerConfig, load_config
from laneserve.server.engine import Engine, EngineStartError
from laneserve.server.lifecycle import Lifecycle

__all__ = [
    "Clock",
    "ConfigError",
    "Engine",
    "EngineStartError",
    "LaneConfig",
    "LaneServer",
    "Lifecycle",
    "ManualClock",
    "ServerConfig",
    "SystemClock",
    "load_config",
    "load_engine",
]
