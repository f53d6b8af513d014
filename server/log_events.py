"""`log_event`: one log line for one event, with its fields for machines.

The formatters in telemetry/logs.py render the fields as key=value (text) or as JSON
members, next to the event's name. It lives here, importing nothing of laneserve, and
not in telemetry/: the modules telemetry imports (engine, memory, events, the scheduler)
log events too, and could not import it from there (an import cycle).
"""

from __future__ import annotations

import logging
import sys
from typing import Any


def event_extra(event: str, **fields: Any) -> dict[str, Any]:
    """The `extra` of a logging call that makes its line the event `event`: for
    `log.exception` (with the traceback), which `log_event` does not write."""
    return {"event": event, "fields": fields}


def log_event(logger: logging.Logger, level: int, event: str, message: str, **fields: Any) -> None:
    """One log line for one event: `message` for people, `fields` for machines (rendered
    as key=value in text, as JSON members with --log-format json)."""
    logger.log(level, message, extra=event_extra(event, **fields))


__all__ = ["event_extra", "log_event"]


def refuse_usage(logger: logging.Logger, message: str, *, json_lines: bool) -> None:
    """A refused command line (its command exits 2): under JSON logs one JSON line, the
    event `usage_error` (log shippers parse every line), else `message` on stderr."""
    if json_lines:
        log_event(logger, logging.ERROR, "usage_error", message, exit_code=2)
    else:
        print(message, file=sys.stderr)
