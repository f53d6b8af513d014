"""Event logs: the formatters of event lines (`log_events.log_event`), text or JSON, the
handler that writes them to stderr without ever making the logging thread wait
(`configure_logging`, `QueuedStreamHandler`), and `EventLog`, the `SchedulerEvents` sink
for what an operator must hear of unasked (refusals, sheds and failures in aggregate, each
through an `AggregatedLine`; out of memory, batch cap moves)."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import functools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, ParamSpec, TextIO

from laneserve.server.clock import StartTimer, Timer
from laneserve.server.errors import (
    AnswerTooLargeError,
    DeviceMemoryError,
    DrainingError,
    EngineError,
    ExpiredInQueueError,
    InvalidInputError,
    LaneserveError,
    RegionNotFoundError,
    RequestIdReusedError,
    ServerFaultError,
    SharedMemoryRefusedError,
    UnsupportedError,
    bounded_message,
)
from laneserve.server.events import NullEvents
from laneserve.server.items import Batch, Signature
from laneserve.server.log_events import event_extra, log_event

# Every telemetry log line under one name, the package's (filters and tests use it).
log = logging.getLogger("laneserve.server.telemetry")

# Every aggregated line (refusals, sheds, failures: see `AggregatedLine`) writes its first
# occurrence at once, then at most one line per interval.
REFUSAL_LOG_INTERVAL_S = 10.0
# An aggregated line written this long after the last occurrence it counts says how long
# ago.
LATE_LINE_S = 0.1
# Refusals that say nothing of overload: a deploy's drain, clients' invalid requests (a
# bug on their side: a malformed request, a shared memory region not registered or
# shared memory refused, a feature not served), answers over a client's own receive
# limit, and callers that left while they waited for room. Logged apart from the
# overload refusals
# (`admission_refused`), at INFO: a deploy drew WARNINGs. ENGINE_FAILURE (a submission
# after the scheduler failed for good: the server is stopping) stays with the WARNINGs.
ROUTINE_REFUSALS = frozenset(
    {
        DrainingError.reason,
        InvalidInputError.reason,
        RegionNotFoundError.reason,
        SharedMemoryRefusedError.reason,
        UnsupportedError.reason,
        RequestIdReusedError.reason,
        AnswerTooLargeError.reason,
        "CANCELLED",
    }
)
# The start of gRPC's record (on GRPC_PER_CALL_LOGGER) of an answer it could not send
# (`UnsentAnswers`), counted in the answers_unsent line under this reason.
_UNSENT_PREFIX: Final = "ExecuteBatchError raised in core by servicer method ["
_CALL_ENDED: Final = "CALL_ENDED"
# The ends of requests that the model failed on (logged as `requests_failed`): an error
# of the runtime's (INTERNAL), or a row too large for the memory even alone
# (RESOURCE_EXHAUSTED). A ServerFaultError, laneserve's own failure, has the reason
# ENGINE_FAILURE too and is left out: it is logged at ERROR where it happened.
FAILED_REASONS = frozenset({EngineError.reason, DeviceMemoryError.reason})
# A requests_failed line names at most so many of its requests (the first ones), for an
# operator to match a client's error (INTERNAL, or RESOURCE_EXHAUSTED DEVICE_MEMORY) to it.
MAX_REQUEST_IDS = 5
# The name of the threads `start_timer` starts: laneserve's, as the tests' leak check
# looks for.
LOG_TIMER_THREAD = "laneserve-log-timer"
# The event of a line that is not one of laneserve's events (another library's: grpc,
# asyncio, onnxruntime's Python layer): log shippers key on `event`, so every JSON line
# has one.
OTHER_LOG_EVENT = "log"
# Log lines waiting for stderr, at most: so many lines, or so many characters of them (a
# line with a traceback is kilobytes), whichever comes first; the line that reaches the
# character bound is kept, so a line longer than it is written when nothing waits. Past
# either a line is dropped and counted, and the event LOG_LINES_DROPPED says how many once
# the writer catches up.
LOG_QUEUE_LINES = 10_000
LOG_QUEUE_CHARS = 8 * 2**20
LOG_LINES_DROPPED = "log_lines_dropped"
# grpc's asyncio layer logs at DEBUG per call ("[_cygrpc] Loaded running loop" on every
# RPC, "RPC cancelled for servicer method" on every cancelled one): at --log-level debug
# nearly every line under overload (README, Observability), drowning laneserve's own.
# This logger is kept at INFO unless GRPC_VERBOSITY=DEBUG asks for gRPC's debugging.
GRPC_PER_CALL_LOGGER = "grpc._cython.cygrpc"
# Flushing or closing the log (at exit: `logging.shutdown` does both) waits for its queued
# lines while they are being written, and gives up once one write has waited this long: a
# stderr nobody reads (a stuck supervisor) would otherwise hold the exit for ever.
LOG_STALL_S = 2.0


def start_timer(delay_s: float, action: Callable[[], None]) -> Timer:
    """Runs `action` on a daemon thread after `delay_s` (it does not hold up exit)."""
    timer = threading.Timer(delay_s, action)
    timer.name = LOG_TIMER_THREAD
    timer.daemon = True
    timer.start()
    return timer


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message event=NAME key=value ...` (the event and its fields
    where the line is one of laneserve's events: its name as JSON lines give it, so that
    an operator greps text logs for `event=drain_incomplete` as README names it)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        event: str | None = getattr(record, "event", None)
        fields: Mapping[str, Any] = getattr(record, "fields", {})
        if event is None and not fields:
            return line
        head, newline, rest = line.partition("\n")  # a traceback stays below
        pairs = [] if event is None else [f"event={event}"]
        pairs += [f"{key}={_text_value(value)}" for key, value in fields.items()]
        return f"{head} {' '.join(pairs)}{newline}{rest}"


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
    """The process's log handler, the root logger's (every library's lines go through it
    too): one line per event on stderr, text or JSON, written by a thread of its own (see
    `QueuedStreamHandler`). The handler it replaces is closed: its lines are written first.
    At `level` debug gRPC's per-call lines stay out (GRPC_PER_CALL_LOGGER) unless
    GRPC_VERBOSITY=DEBUG asks for them.
    An uncaught exception's traceback, which Python writes to stderr directly, waits for the
    lines logged before it (`sys.excepthook` and `threading.excepthook` flush the log)."""
    handler = QueuedStreamHandler()
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter())
    logging.basicConfig(handlers=[handler], force=True)
    set_log_level(getattr(logging, level.upper()))
    _flush_logs_before_tracebacks()


def set_log_level(level: int) -> None:
    """The root logger's threshold (`logging.DEBUG` ... `logging.ERROR`), at start
    (`configure_logging`) and while the server runs (Triton's LogSettings, settings.py),
    with gRPC's per-call logger (GRPC_PER_CALL_LOGGER) kept at INFO unless
    GRPC_VERBOSITY=DEBUG asks for its lines: set on every call, not only at debug, so
    that each call's environment decides anew."""
    logging.getLogger().setLevel(level)
    logging.getLogger(GRPC_PER_CALL_LOGGER).setLevel(
        logging.NOTSET if _grpc_debugging() else logging.INFO
    )


def log_format() -> str:
    """How the process's log lines are written, as `--log-format` names it: "json" where
    a handler of the root logger formats them as JSON (`JsonFormatter`), else "text"."""
    json_lines = any(
        isinstance(handler.formatter, JsonFormatter) for handler in logging.getLogger().handlers
    )
    return "json" if json_lines else "text"


def _grpc_debugging() -> bool:
    """Whether the operator asked for gRPC's own debugging: GRPC_VERBOSITY=DEBUG, which
    turns on its C core's debug lines too (see cli.py)."""
    return os.environ.get("GRPC_VERBOSITY", "").strip().upper() == "DEBUG"


# Marks the exception hooks `_flush_logs_before_tracebacks` installed.
_FLUSHES_LOGS = "_laneserve_flushes_logs"
_P = ParamSpec("_P")


def _flush_logs_before_tracebacks() -> None:
    """Wraps `sys.excepthook` and `threading.excepthook` in hooks that flush the log, then
    call the hook they wrap. Once: a hook of ours is not wrapped again (configure_logging
    runs more than once in a process: tests, a CLI's re-exec). Each wrapper holds the hook
    it wraps, and `flush_logs` looks up the root logger's handlers when it runs: a handler
    closed since is not flushed (it writes at once)."""
    if not getattr(sys.excepthook, _FLUSHES_LOGS, False):
        sys.excepthook = _flushing_first(sys.excepthook)
    if not getattr(threading.excepthook, _FLUSHES_LOGS, False):
        threading.excepthook = _flushing_first(threading.excepthook)


def _flushing_first(hook: Callable[_P, object]) -> Callable[_P, None]:
    """`hook`, after `flush_logs`; marked as ours (_FLUSHES_LOGS)."""

    def flushing(*args: _P.args, **kwargs: _P.kwargs) -> None:
        flush_logs()
        hook(*args, **kwargs)

    setattr(flushing, _FLUSHES_LOGS, True)
    return flushing


def flush_logs() -> bool:
    """Waits until the lines `configure_logging`'s handler holds are written (within
    LOG_STALL_S of a write that does not end): before a line written to stderr directly
    must come after them, or a test reads stderr. False: gave up on a write."""
    flushed = [
        handler.flush_lines()
        for handler in logging.getLogger().handlers
        if isinstance(handler, QueuedStreamHandler)
    ]
    return all(flushed)


class QueuedStreamHandler(logging.Handler):
    """Writes each record's line to `stream` (stderr by default) from a thread of its
    own, in the order they were logged; the thread that logs never waits for the stream.

    Written where it was logged, a line blocked its thread while stderr was a full pipe
    (a supervisor that stopped reading): the event loop, or the scheduler thread with
    the scheduler's lock held, and with them every call, health checks included. Lines
    are formatted where they are logged (they say what was true then) and queued, at
    most `max_lines` or `max_chars` (see LOG_QUEUE_CHARS); past either a line is dropped
    and counted (`dropped_lines`), and once the writer has written every queued line it
    writes one, the event LOG_LINES_DROPPED, that says how many. `flush_lines` and
    `close` wait for the queued lines (bounded by `stall_s`, see LOG_STALL_S, and not at
    all without a live writer); a line logged after `close` is written at once, where it
    is logged, as `logging.StreamHandler` would, and so is one no writer thread can start
    for (the thread limit; interpreter shutdown on Python >= 3.12: a line logged from an
    atexit hook). A writer that died (an exception its stream raised that `Exception`
    does not catch) is replaced by the next line.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        max_lines: int = LOG_QUEUE_LINES,
        max_chars: int = LOG_QUEUE_CHARS,
        stall_s: float = LOG_STALL_S,
    ) -> None:
        super().__init__()
        self._stream = sys.stderr if stream is None else stream
        self._max_lines = max_lines
        self._max_chars = max_chars
        self._stall_s = stall_s
        # Guards everything below. Only the writer thread takes lines off `_lines`.
        self._cond = threading.Condition(threading.Lock())
        self._lines: collections.deque[str] = collections.deque()
        self._queued_chars = 0  # of `_lines`
        self._writing_since_s: float | None = None  # the line the writer holds: since when
        self._unsaid_drops = 0  # dropped since the last LOG_LINES_DROPPED line
        self._dropped_lines = 0
        self._closed = False
        # Started by the first line, ended by `close` once every line is written.
        self._writer: threading.Thread | None = None
        self._writer_done = False

    @property
    def dropped_lines(self) -> int:
        """Lines dropped, in all, because the queue was full."""
        with self._cond:
            return self._dropped_lines

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # noqa: BLE001 - logging.Handler's convention: report, go on
            self.handleError(record)
            return
        with self._cond:
            if self._closed and (self._writer is None or self._writer_done):
                unqueued = [line]
            else:
                # Closed with the writer still at work (or given up on), it queues too.
                unqueued = self._queue(line)
        for pending in unqueued:
            self._write(pending)  # emit runs under the handler's lock: in order

    def _queue(self, line: str) -> list[str]:
        """Queues `line` for the writer, starting one if none is alive, or drops it. The
        lines the caller is to write itself: every queued one when no thread can start."""
        if len(self._lines) >= self._max_lines or self._queued_chars >= self._max_chars:
            self._unsaid_drops += 1
            self._dropped_lines += 1
        else:
            self._lines.append(line)
            self._queued_chars += len(line)
            self._cond.notify_all()
        # Also when the line was dropped: a writer that died with the queue full is
        # replaced, or every later line would be dropped and none written.
        if self._writer is not None and self._writer.is_alive():
            return []
        self._writer = threading.Thread(
            target=self._write_lines, name="laneserve-log-writer", daemon=True
        )
        try:
            self._writer.start()
        except RuntimeError:
            # Written here, they block this thread only if stderr is not read as well;
            # dropped, they would be lost whenever no thread can start (at exit, Python >=
            # 3.12: every line an atexit hook logs), stderr read or not.
            self._writer = None
            return self._take_queued()
        return []

    def _take_queued(self) -> list[str]:
        """The queued lines, taken off the queue (for the caller to write): called with
        `_cond` held."""
        lines = list(self._lines)
        self._lines.clear()
        self._queued_chars = 0
        return lines

    def flush(self) -> None:
        self.flush_lines()

    def flush_lines(self) -> bool:
        """Waits until every queued line is written; False if a write stalled (took
        `stall_s`) first."""
        return self._wait_for(
            lambda: not self._lines and self._writing_since_s is None and not self._unsaid_drops
        )

    def close(self) -> None:
        """Writes the queued lines and ends the writer, or gives up on it once a write
        has stalled (`stall_s`): it is a daemon thread, and does not hold up the exit."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        done = self._wait_for(lambda: self._writer is None or self._writer_done)
        if done and self._writer is not None:
            self._writer.join()  # it has returned, or is returning
        with self._cond:
            # Left behind a writer that died (and no line since to replace it): written
            # here, or they were lost at exit.
            alive = self._writer is not None and self._writer.is_alive()
            orphaned = [] if alive else self._take_queued()
        for line in orphaned:
            self._write(line)
        super().close()

    def _wait_for(self, done: Callable[[], bool]) -> bool:
        with self._cond:
            while not done():
                # Nothing would make it so: no writer (none could start, or it died), or
                # this is the writer (its thread's excepthook, see configure_logging).
                writer = self._writer
                if writer is None or writer is threading.current_thread() or not writer.is_alive():
                    return False
                writing_s = (
                    0.0
                    if self._writing_since_s is None
                    else time.monotonic() - self._writing_since_s
                )
                if writing_s >= self._stall_s:
                    return False
                self._cond.wait(self._stall_s - writing_s)
            return True

    def _write_lines(self) -> None:
        """The writer thread: the queued lines in order, then how many were dropped,
        until closed with nothing left to write."""
        while True:
            with self._cond:
                while not (self._lines or self._unsaid_drops or self._closed):
                    self._cond.wait()
                line: str | None = None
                dropped = 0
                if self._lines:
                    line = self._lines.popleft()
                    self._queued_chars -= len(line)
                elif self._unsaid_drops:
                    dropped, self._unsaid_drops = self._unsaid_drops, 0
                else:
                    self._writer_done = True
                    self._cond.notify_all()
                    return
                self._writing_since_s = time.monotonic()
            try:
                self._write(self._dropped_line(dropped) if line is None else line)
            finally:
                # Also when this thread dies of it: a dead writer is not writing.
                with self._cond:
                    self._writing_since_s = None
                    self._cond.notify_all()

    def _dropped_line(self, dropped: int) -> str:
        record = log.makeRecord(
            log.name,
            logging.WARNING,
            __file__,
            0,
            f"dropped {dropped} log line(s): stderr was not read while its queue was full "
            f"({self._max_lines} lines or {self._max_chars} characters waiting)",
            (),
            None,
            extra=event_extra(
                LOG_LINES_DROPPED,
                dropped=dropped,
                queue_lines=self._max_lines,
                queue_chars=self._max_chars,
            ),
        )
        try:
            return self.format(record)
        except Exception:  # noqa: BLE001 - the writer must not die of its own line
            return record.getMessage()

    def _write(self, line: str) -> None:
        try:
            self._stream.write(line + "\n")
            self._stream.flush()
        except Exception:  # noqa: BLE001 - logging.Handler's convention: report, go on
            self.handleError(logging.makeLogRecord({"msg": line}))


@dataclasses.dataclass(frozen=True, slots=True)
class Window:
    """What an `AggregatedLine` writes: the occurrences of its event since its last line."""

    counts: dict[tuple[str, str], int]  # by (lane, reason), in the order first seen
    rows: int  # the rows the occurrences carried (those that gave any)
    window_s: float  # from the first occurrence to the last
    ago_s: float  # from the last occurrence to the line
    first_detail: str | None  # the first detail an occurrence gave (an error's message)
    request_ids: tuple[str, ...]  # of the first MAX_REQUEST_IDS occurrences that gave one

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def by_key(self) -> dict[str, int]:
        """The counts keyed "lane/reason", as the line's fields give them."""
        return {f"{lane}/{reason}": count for (lane, reason), count in self.counts.items()}

    def late(self) -> str:
        """What the message adds when the line comes well after its last occurrence."""
        return f", the last {self.ago_s:.1f}s ago" if self.ago_s >= LATE_LINE_S else ""

    def timing(self) -> dict[str, float]:
        """The fields every line gives of its window: its length and how long ago it
        ended."""
        return {"window_s": round(self.window_s, 3), "last_ago_s": round(self.ago_s, 3)}

    def firsts(self, detail_field: str) -> dict[str, Any]:
        """The fields a line of errors gives: the first detail given, as `detail_field`
        ("" where none gave one), and the first MAX_REQUEST_IDS request ids. In fields
        alone, not the message: a text line appends the fields to it, and 1 KiB of the
        runtime's words came twice."""
        return {
            detail_field: bounded_message(self.first_detail or ""),
            "request_ids": list(self.request_ids),
        }


class AggregatedLine:
    """One event that comes in bursts of thousands (refusals, sheds, failures), logged
    in aggregate: its first occurrence at once, then at most one line per `interval_s`
    with the counts by lane and reason. A burst's last line is due when its interval
    ends, whatever happens next: a timer writes it (it waited for the next event, which
    a server idle after a flood may not see for hours, or for `close`).

    `add` is called on the scheduler's thread (under its lock) or the event loop: it
    counts and keeps references, and formats nothing; `write` makes the line, outside
    this object's lock, only when one is due.
    """

    def __init__(
        self,
        write: Callable[[Window], None],
        *,
        interval_s: float,
        monotonic: Callable[[], float],
        timer: StartTimer,
    ) -> None:
        self._write = write
        self._interval_s = interval_s
        self._monotonic = monotonic
        self._start_timer = timer
        self._lock = threading.Lock()
        # The timer due to write the occurrences not yet logged (None: none pending).
        self._timer: Timer | None = None
        self._closed = False
        # Since the last line: the counts, and what the line says beside them.
        self._counts: dict[tuple[str, str], int] = {}
        self._rows = 0
        self._first_detail: str | None = None
        self._request_ids: list[str] = []
        self._window_start_s = monotonic()
        self._last_s = self._window_start_s
        self._last_line_s = -float("inf")

    def add(
        self,
        lane: str,
        reason: str,
        *,
        rows: int = 0,
        detail: str | None = None,
        request_id: str | None = None,
    ) -> None:
        key = (lane, reason)
        with self._lock:
            now_s = self._monotonic()
            if not self._counts:
                # A burst's window opens at its first occurrence, not at the last line.
                self._window_start_s = now_s
            if self._first_detail is None:  # the first given (`_take` clears it): a refusal
                self._first_detail = detail  # tells a caller that had left nothing
            self._last_s = now_s
            self._counts[key] = self._counts.get(key, 0) + 1
            self._rows += rows
            if request_id and len(self._request_ids) < MAX_REQUEST_IDS:
                self._request_ids.append(request_id)
            window = self._take_if_due(now_s)
        if window is not None:
            self._write(window)

    def flush(self) -> None:
        """Writes whatever is held, due or not."""
        with self._lock:
            window = self._take(self._monotonic()) if self._counts else None
        if window is not None:
            self._write(window)

    def close(self) -> None:
        """Writes what is left and stops the timer: call once, at stop. An occurrence
        after it is written at once (no timer would write it)."""
        with self._lock:
            self._closed = True
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        self.flush()

    def _on_timer(self) -> None:
        with self._lock:
            self._timer = None
            # Occurrences held while this timer waited to run (one meanwhile wrote the
            # line it was due for, and the next found it still set) are due an interval
            # after that line: `_take_if_due` arms a timer of their own.
            window = self._take_if_due(self._monotonic())
        if window is not None:
            self._write(window)

    def _take_if_due(self, now_s: float) -> Window | None:
        """Under the lock: the window to write now if the interval since the last line is
        over, or once closed (no timer would write it); else None, with a timer armed for
        when it is (unless one is)."""
        if not self._counts:
            return None
        if self._closed or now_s - self._last_line_s >= self._interval_s:
            return self._take(now_s)
        if self._timer is None:
            due_s = self._last_line_s + self._interval_s - now_s
            self._timer = self._start_timer(max(due_s, 0.0), self._on_timer)
        return None

    def _take(self, now_s: float) -> Window:
        """Under the lock: what is held, as a window; the next one starts empty."""
        window = Window(
            counts=self._counts,
            rows=self._rows,
            # From the first occurrence to the last: a line written late (by the next
            # event, or at shutdown) does not stretch a short burst over the quiet after.
            window_s=self._last_s - self._window_start_s,
            ago_s=now_s - self._last_s,
            first_detail=self._first_detail,
            request_ids=tuple(self._request_ids),
        )
        self._counts, self._rows, self._first_detail, self._request_ids = {}, 0, None, []
        self._window_start_s = self._last_line_s = now_s
        return window


class EventLog(NullEvents):
    """A `SchedulerEvents` sink for the events an operator must hear of unasked.

    Refusals, sheds and failures come in bursts of thousands, so each is logged in
    aggregate (`AggregatedLine`): `admission_refused` (overload, and submissions after
    the scheduler failed: WARNING) and `admission_refused_routine` (draining, invalid or
    withdrawn requests, answers over a caller's receive limit: INFO), `requests_shed`
    (queued work dropped unrun: WARNING when any expired in its queue, INFO when its
    callers all left) and `requests_failed` (the model failed on them, not laneserve:
    WARNING, with the first error and the first few request ids). Out of memory and each
    move of the batch cap are logged as they happen; they are rare by construction (the
    cap halves on each).
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

        def line(write: Callable[[Window], None]) -> AggregatedLine:
            return AggregatedLine(write, interval_s=interval_s, monotonic=monotonic, timer=timer)

        self._refused = line(
            functools.partial(self._write_refused, logging.WARNING, "admission_refused", "")
        )
        self._refused_routine = line(
            functools.partial(
                self._write_refused,
                logging.INFO,
                "admission_refused_routine",
                ", none for overload (draining, invalid or withdrawn requests, shared memory "
                "not registered or refused, features not served, answers over a caller's "
                "receive limit)",
            )
        )
        self._shed = line(self._write_shed)
        self._failed = line(self._write_failed)
        self._unsent = line(self._write_unsent)
        self._malformed = line(self._write_malformed)
        self._lines = (
            self._refused,
            self._refused_routine,
            self._shed,
            self._failed,
            self._unsent,
            self._malformed,
        )
        # What an out-of-memory ran out of, as its line says: the server sets it from
        # where its session runs ("device": the GPU's memory; "host arena": the CPU
        # arena that --memory-limit caps).
        self.arena = "device"
        # The batch formed and not yet done: the one running (the scheduler hands the
        # session one batch at a time). Its out-of-memory runs are reported while it is
        # done (before `batch_done`), and a drain that ends says which one it left.
        self.running_batch: Batch | None = None

    def rejected(
        self,
        lane: str,
        reason: str,
        waited_s: float,
        *,
        request_id: str | None = None,
        error: LaneserveError | None = None,
    ) -> None:
        line = self._refused_routine if reason in ROUTINE_REFUSALS else self._refused
        line.add(
            lane, reason, detail=None if error is None else error.message, request_id=request_id
        )

    def shed(self, lane: str, reason: str, rows: int) -> None:
        self._shed.add(lane, reason, rows=rows)

    def completed(
        self,
        lane: str,
        status: str,
        *,
        request_id: str | None = None,
        error: LaneserveError | None = None,
    ) -> None:
        if (
            error is not None
            and status in FAILED_REASONS
            and not isinstance(error, ServerFaultError)
        ):
            self._failed.add(lane, status, detail=error.message, request_id=request_id)

    def answer_unsent(self, method: str) -> None:
        """gRPC could not send an answer of `method` (its full name): the call had ended
        (its deadline passed, or its caller left) while the answer waited for the event
        loop (`UnsentAnswers`)."""
        self._unsent.add(method, _CALL_ENDED)

    def http_malformed(self, problem: str) -> None:
        """aiohttp refused an HTTP request it could not parse (`problem`: its error's
        class, BadHttpMessage, LineTooLong, ...), before any route."""
        self._malformed.add("http", problem)

    def flush(self) -> None:
        for line in self._lines:
            line.flush()

    def close(self) -> None:
        """Writes what is left and stops the timers: call once, at stop."""
        for line in self._lines:
            line.close()

    @staticmethod
    def _write_refused(level: int, event: str, why: str, window: Window) -> None:
        log_event(
            log,
            level,
            event,
            f"admission refused {window.total} request(s) in {window.window_s:.1f}s"
            f"{window.late()}{why}",
            refused=window.by_key(),
            # What the first was told, and whose the first few were: a flood of bad
            # requests ("interactive/INVALID_INPUT": 3935) said nothing of what was wrong
            # or who sent it.
            **window.firsts("first_refusal"),
            **window.timing(),
        )

    def _write_shed(self, window: Window) -> None:
        expired = sum(
            count
            for (_, reason), count in window.counts.items()
            if reason == ExpiredInQueueError.reason
        )
        why = (
            f"; {expired} of them expired in the queue (overload: the lanes hold more than "
            "the session serves within their deadlines)"
            if expired
            else "; their callers left"
        )
        log_event(
            log,
            logging.WARNING if expired else logging.INFO,
            "requests_shed",
            f"dropped {window.total} queued request(s) ({window.rows} rows) without running "
            f"them in {window.window_s:.1f}s{window.late()}{why}",
            shed=window.by_key(),
            rows=window.rows,
            **window.timing(),
        )

    @staticmethod
    def _write_unsent(window: Window) -> None:
        log_event(
            log,
            logging.INFO,
            "answers_unsent",
            f"gRPC could not send {window.total} answer(s) in {window.window_s:.1f}s"
            f"{window.late()}: their calls had ended first (a deadline passed, or the caller "
            "left, while the answer waited for its turn on the event loop); those counted OK "
            "were not received",
            unsent={method: count for (method, _), count in window.counts.items()},
            **window.timing(),
        )

    @staticmethod
    def _write_malformed(window: Window) -> None:
        log_event(
            log,
            logging.INFO,
            "http_requests_malformed",
            f"the HTTP port refused {window.total} request(s) it could not parse in "
            f"{window.window_s:.1f}s{window.late()} (answered 400 by the HTTP parser: a "
            "client's fault, or a scan)",
            malformed={problem: count for (_, problem), count in window.counts.items()},
            **window.timing(),
        )

    def _write_failed(self, window: Window) -> None:
        log_event(
            log,
            logging.WARNING,
            "requests_failed",
            f"{window.total} request(s) failed in the model in {window.window_s:.1f}s"
            f"{window.late()}",
            failed=window.by_key(),
            **window.firsts("first_error"),
            **window.timing(),
        )

    # `admitted` stays NullEvents' no-op: it is called under the scheduler's lock on
    # every admission, and each line that falls due is written by its own timer.

    def batch_formed(self, batch: Batch, queue_waits_s: Sequence[float | None]) -> None:
        self.running_batch = batch

    def batch_done(
        self,
        batch: Batch,
        run_s: float,
        error: LaneserveError | None,
        failed_rows: int = 0,
        *,
        split: bool = False,
    ) -> None:
        if self.running_batch is batch:
            self.running_batch = None

    def out_of_memory(self, rows: int) -> None:
        batch = self.running_batch
        of_batch = "" if batch is None else f" of batch {batch.batch_id}"
        log_event(
            log,
            logging.WARNING,
            "out_of_memory",
            f"out of memory ({self.arena}) running {rows} rows{of_batch}"
            + ("; splitting them and retrying" if rows > 1 else ""),
            rows=rows,
            batch_id=None if batch is None else batch.batch_id,
            memory=self.arena,
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


class UnsentAnswers(logging.Filter):
    """On gRPC's logger (GRPC_PER_CALL_LOGGER): gRPC's ERROR record, with a ~20-line
    traceback, of an answer of laneserve's services it could not send because the call
    had ended in its core first (the caller left, or its deadline passed, between the
    handler's return and the send: "ExecuteBatchError raised in core by servicer method
    [METHOD]") becomes a count in `events`' aggregated `answers_unsent` line (INFO). Under
    overload with short deadlines that is routine (1-12 a drill, 21 in a 25 s soak), not
    a fault, and an alert on ERROR lines fired for it; an answer counted OK by the ledger
    as the handler returned it was then not received. Read from the record's message,
    where gRPC formats the method in (a filter that read it from the record's arguments
    matched none). Another service's record (an embedding application's) passes, as does
    every other record. With two servers in one process the first installed counts both.
    A floor: gRPC drops some such answers without a record (a drill: 5-11 a run, none
    counted), which only its own call counts (`grpc_calls` failed) include."""

    def __init__(self, events: EventLog) -> None:
        super().__init__()
        self._events = events
        self._lock = threading.Lock()  # the metrics' reader is another thread
        self._prefixes: tuple[str, ...] = ()  # the services' "/NAME/", once `watch`ing
        self._counts: dict[str, int] = {}  # since the start, by method

    def watch(self, services: Sequence[str], inference_methods: Sequence[str]) -> None:
        """Counts the records of `services`' methods (by full name) from now; the
        inference methods' series there from the start, at 0, as every other counter's
        (a rate over a series that appears later is none)."""
        self._prefixes = tuple(f"/{service}/" for service in services)
        with self._lock:
            for method in inference_methods:
                self._counts.setdefault(method, 0)

    def counts(self) -> dict[str, int]:
        """The answers gRPC could not send since the start, by method (the metric's)."""
        with self._lock:
            return dict(self._counts)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record its handler reports; not raised into gRPC
            return True
        if not message.startswith(_UNSENT_PREFIX) or not message.endswith("]"):
            return True
        method = message[len(_UNSENT_PREFIX) : -1]
        if not method.startswith(self._prefixes):
            return True
        with self._lock:
            self._counts[method] = self._counts.get(method, 0) + 1
        self._events.answer_unsent(method)
        return False
