"""laneserve server: one ONNX model, bounded priority lanes, one batching scheduler.

The request path, module by module: config -> lanes -> scheduler (policy) ->
scheduler_thread (threads) -> engine (the session) -> service (gRPC; kserve, the KServe
v2 front end in front of it), with errors, codec, memory (budget, watermark),
idempotency and events/stats beside them;
telemetry/ turns events into traces, metrics and logs; app assembles a serving
process, cli runs it (entry first: the console script, which catches the stop signals
before the heavy imports), process tunes the interpreter for it (GIL switching, GC).

The names below are imported when first used (PEP 562): a process that imports one
submodule (the benchmark's load generators, `laneserve top`) does not load ONNX
Runtime and the whole server with it.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# ONNX Runtime (1.29 on, Linux too) writes a device id under ~/.cache/Microsoft and
# uploads usage events to Microsoft unless ORT_DISABLE_TELEMETRY is set when it is first
# imported: a server must not call out of its network unasked. Set here, as every module
# that imports onnxruntime (the engine, providers) is imported through this package; an
# operator's own value (0 lets it send) is kept.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

if TYPE_CHECKING:
    from laneserve.server.app import LaneServer, load_engine
    from laneserve.server.clock import Clock, ManualClock, SystemClock
    from laneserve.server.config import ConfigError, LaneConfig, ServerConfig, load_config
    from laneserve.server.engine import Engine
    from laneserve.server.errors import EngineStartError
    from laneserve.server.lifecycle import Lifecycle

# Each public name and the submodule that defines it.
_HOMES = {
    "LaneServer": "app",
    "load_engine": "app",
    "Clock": "clock",
    "ManualClock": "clock",
    "SystemClock": "clock",
    "ConfigError": "config",
    "LaneConfig": "config",
    "ServerConfig": "config",
    "load_config": "config",
    "Engine": "engine",
    "EngineStartError": "errors",
    "Lifecycle": "lifecycle",
}

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


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # the next lookup is an ordinary one
    return value
