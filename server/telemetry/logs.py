"""Event logs: the formatters of event lines (`log_events.log_event`), text or JSON
(`configure_logging`), and `EventLog`, the `SchedulerEvents` sink for what an operator
must hear of unasked (refusals in aggregate, out of memory, batch cap moves)."""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from laneserve.server.clock import StartTimer, Timer
from laneserve.server.errors import LaneserveError
from laneserve.server.items import Batch, Signature
from laneserve.server.log_events import log_event

# Every telemetry log line under one name, the package's (filters and tests use it).
log = logging.getLogger("laneserve.server.telemetry")

# Refusals are logged in aggregate: the first at once, then at most one line per interval.
REFUSAL_LOG_INTERVAL_S = 10.0
# A refusal line written this long after the last refusal it counts says how long ago.
LATE_LINE_S = 0.1
# The event of a line that is not one of laneserve's events (another library's: grpc,
# asyncio, onnxruntime's Python layer): log shippers key on `event`, so every JSON line
# has one.
OTHER_LOG_EVENT = "log"


def start_timer(delay_s: float, action: Callable[[], None]) -> Timer:
    """Runs `action` on a daemon thread after `delay_s` (it does not hold up exit)."""
    timer = threading.Timer(delay_s, action)
    timer.daemon = True
    timer.start()
    return timer


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message key=value ...`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields: Mapping[str, Any] = getattr(record, "fields", {})
        if not fields:
            return line
        head, newline, rest = line.partition("\n")  # a traceback stays below
        pairs = " ".join(f"{key}={_text_value(value)}" for key, value in fields.items())
        return f"{head} {pairs}{newline}{rest}"


def _text_value(value: Any) -> str:
    if not isinstance(value, str):
        return json.dumps(value, default=str, separators=(",", ":"))
    return json.dumps(value) if value == "" or any(c.isspace() for c in value) else value


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, event, message and
    the event's fields. A line that is no event of laneserve's (another library's) has
    the event OTHER_LOG_EVENT."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
        }
        document["event"] = getattr(record, "event", None) or OTHER_LOG_EVENT
        document["message"] = record.getMessage()
        document.update(getattr(record, "fields", {}))
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        return json.dumps(document, default=str)


def configure_logging(level: str, *, json_lines: bool = False) -> None:
    """The process's log handler: one line per event on stderr, text or JSON."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter())
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)


class EventLog:
    """A `SchedulerEvents` sink for the events an operator must hear of unasked.

    Refusals come in bursts of thousands, so they are logged in aggregate: the first at
    once, then at most one line per `interval_s` with the counts by lane and reason. A
    burst's last line is due when its interval ends, whatever happens next: a timer
    writes it (it waited for the next event, which a server idle after a flood may not
    see for hours, or for `close`). Out of
    memory and each move of the batch cap are logged as they happen; they are rare by
    construction (the cap halves on each).
    """

    def __init__(
        self,
        *,
        max_batch_size: int,
        interval_s: float = REFUSAL_LOG_INTERVAL_S,
        monotonic: Callable[[], float] = time.monotonic,
        timer: StartTimer = start_timer,
    ) -> None:
        self._max_batch_size = max_batch_size
        self._interval_s = interval_s
        self._monotonic = monotonic
        self._start_timer = timer
        self._lock = threading.Lock()
        # The timer due to write the refusals not yet logged (None: none pending).
        self._timer: Timer | None = None
        self._closed = False
        self._refused: dict[str, int] = {}
        self._window_start_s = monotonic()
        self._last_refused_s = self._window_start_s
        self._last_line_s = -float("inf")

    def rejected(self, lane: str, reason: str) -> None:
        key = f"{lane}/{reason}"
        with self._lock:
            now_s = self._monotonic()
            if not self._refused:
                # A burst's window opens at its first refusal, not at the last line.
                self._window_start_s = now_s
            self._last_refused_s = now_s
            self._refused[key] = self._refused.get(key, 0) + 1
        self._maybe_flush()
        self._arm_timer()

    def _on_timer(self) -> None:
        with self._lock:
            self._timer = None
        self._maybe_flush()
        # Refusals held while this timer waited to run (a refusal meanwhile wrote the line
        # it was due for, and the next found it still set) are due an interval after that
        # line: no other timer was armed for them.
        self._arm_timer()

    def _arm_timer(self) -> None:
        """Arms the timer that writes the refusals held, due when the interval since the
        last line ends, unless one is armed already or the log is closed."""
        with self._lock:
            if self._refused and self._timer is None and not self._closed:
                due_s = self._last_line_s + self._interval_s - self._monotonic()
                self._timer = self._start_timer(max(due_s, 0.0), self._on_timer)

    def close(self) -> None:
        """Writes what is left and stops the timer: call once, at stop."""
        with self._lock:
            self._closed = True
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        self.flush()

    def _maybe_flush(self) -> None:
        if self._refused and self._monotonic() - self._last_line_s >= self._interval_s:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            if not self._refused:
                return
            refused, self._refused = self._refused, {}
            now_s = self._monotonic()
            # From the first refusal to the last: a line flushed late (by the next event,
            # or at shutdown) does not stretch a short burst over the quiet after it.
            window_s = self._last_refused_s - self._window_start_s
            ago_s = now_s - self._last_refused_s
            self._window_start_s = self._last_line_s = now_s
        late = f", the last {ago_s:.1f}s ago" if ago_s >= LATE_LINE_S else ""
        log_event(
            log,
            logging.WARNING,
            "admission_refused",
            f"admission refused {sum(refused.values())} request(s) in {window_s:.1f}s{late}",
            refused=refused,
            window_s=round(window_s, 3),
            last_ago_s=round(ago_s, 3),
        )

    def admitted(self, lane: str, rows: int) -> None:
        self._maybe_flush()

    def batch_done(
        self, batch: Batch, run_s: float, error: LaneserveError | None, failed_rows: int = 0
    ) -> None:
        self._maybe_flush()

    def out_of_memory(self, rows: int) -> None:
        log_event(
            log,
            logging.WARNING,
            "out_of_memory",
            f"out of device memory running {rows} rows"
            + ("; splitting them and retrying" if rows > 1 else ""),
            rows=rows,
        )

    def cap_changed(self, old_rows: int, new_rows: int, reason: str, signature: Signature) -> None:
        lowered = new_rows < old_rows
        # Each input's shape after the row axis: rows of another shape keep their own cap.
        shape = [list(dims) for dims in signature]
        of = f"batch cap of rows shaped {', '.join(map(str, shape))}"
        if lowered:
            message = f"{of} lowered {old_rows} -> {new_rows} ({reason})"
        elif new_rows >= self._max_batch_size:
            message = f"{of} recovered {old_rows} -> {new_rows} (max_batch_size)"
        else:
            message = f"{of} raised {old_rows} -> {new_rows} ({reason})"
        log_event(
            log,
            logging.WARNING if lowered else logging.INFO,
            "batch_cap_changed",
            message,
            old_rows=old_rows,
            new_rows=new_rows,
            reason=reason,
            shape=shape,
        )

    def shed(self, lane: str, reason: str, rows: int) -> None:
        pass

    def batch_formed(self, batch: Batch, queue_waits_s: Sequence[float | None]) -> None:
        pass

    def completed(self, lane: str, status: str) -> None:
        pass

    def batch_split(self, batch_id: int, rows: int, out_of_memory_runs: int) -> None:
        pass

    def memory_sampled(self, used_bytes: int, budget_bytes: int | None) -> None:
        pass

    def request_finished(self, lane: str, status: str, duration_s: float) -> None:
        pass
