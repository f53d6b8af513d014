"""The server's lifecycle: STARTING -> SERVING -> DRAINING -> STOPPED, never backwards."""

from __future__ import annotations

import enum


class Lifecycle(enum.Enum):
    STARTING = "STARTING"  # loading the model and probing; not yet listening
    SERVING = "SERVING"  # admitting requests
    DRAINING = "DRAINING"  # refusing new requests, finishing queued ones
    STOPPED = "STOPPED"  # every request answered, threads joined
