"""`laneserve` command line: `serve` a model, `top` to watch one, `bench` to measure it
against the naive designs, `make-model` to build the demo model."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    # `python -m laneserve.server.cli` (the benchmark, container images, the tests' and
    # scripts' shims) goes the console script's way (laneserve.server.entry): the stop
    # signals are caught first, then this module is imported again, as
    # laneserve.server.cli with the heavy imports below, and its `main` runs. Caught in
    # `main` alone, after those imports, a SIGTERM in their first second was lost as
    # PID 1. This copy, __main__, goes no further.
    from laneserve.server.entry import main as entry_main

    sys.exit(entry_main())

import argparse
import asyncio
import contextlib
import errno
import logging
import os
import signal
import stat
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from laneserve.server import flag_values
from laneserve.server.addresses import check_ports_free
from laneserve.server.app import (
    OPEN_FILES_HINT,
    LaneServer,
    check_open_file_limit,
    load_engine,
)
from laneserve.server.bench import cli as bench_cli
from laneserve.server.clock import Clock, SystemClock
from laneserve.server.config import DEVICES, UINT32_MAX, ConfigError, ServerConfig, load_config
from laneserve.server.errors import EngineStartError
from laneserve.server.lifecycle import REPEAT_WINDOW_S, SignalMeaning, StopSignals
from laneserve.server.log_events import refuse_usage
from laneserve.server.memory import format_bytes, stop_estimates
from laneserve.server.probe import ProbeStopped
from laneserve.server.process import (
    STOP_SIGNALS,
    catch_stop_signals_early,
    die_by_signal,
    release_stop_signals,
    stop_signals_taken,
    tune_for_serving,
)
from laneserve.server.telemetry import configure_logging, log_event
from laneserve.server.telemetry.environment import check_tracing_env
from laneserve.server.telemetry.logs import flush_logs
from laneserve.server.tls import server_credentials
from laneserve.server.top import add_arguments as add_top_arguments
from laneserve.server.top import run as run_top

log = logging.getLogger("laneserve")


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # this process's own command line (PID 1, maybe): see there
        catch_stop_signals_early()
    parser = _parser(json_errors=_asked_log_format(argv) == "json")
    args = parser.parse_args(argv)
    if argv is None and args.command != "serve":
        release_stop_signals()  # theirs to take: Ctrl-C ends `top` with 0, for one
    if argv is None and args.command == "serve" and args.log_format == "json":
        _start_again_without_grpc_core_lines()
    configure_logging(args.log_level, json_lines=args.log_format == "json")
    if args.command == "top":
        return run_top(args)
    if args.command == "bench":
        return bench_cli.run(args, ["laneserve", *(sys.argv[1:] if argv is None else argv)])
    if args.command == "make-model":
        return _make_model(args.path, seed=args.seed)
    try:
        config, flags = _serve_config(args)
        with _named_by_flags(flags):  # the start-up's refusals of settings too
            code, clean = asyncio.run(_serve(config))
    except (ConfigError, EngineStartError, OSError) as error:
        message = _start_failure(error)
        if args.log_format == "json":  # log shippers parse every line: this one too
            log_event(log, logging.ERROR, "startup_failed", message, exit_code=2)
        elif sys.stderr is not None:  # None: started with fd 2 closed
            flush_logs()  # the lines logged before it come first
            # Its reader gone (EPIPE), the line is lost; the exit code still says it.
            with contextlib.suppress(OSError):
                print(f"laneserve: {message}", file=sys.stderr)
        return 2
    if not clean:
        # A run the runtime would not end is still going: exiting normally would wait
        # for it and then abort (SIGABRT) in the runtime's teardown. Every request has its
        # answer and the logs are flushed, so the process ends here.
        logging.shutdown()
        os._exit(code)
    return code


# The [server] key each `serve` flag sets. The overrides are read through it (a flag's
# argparse dest is its name with "_" for "-"), and a value a flag gave that the config
# refuses is named by the flag: `--max-batch-size 0` was refused as server.max_batch_size,
# a key its user never wrote.
_SERVE_FLAGS = {
    "model_name": "--model-name",
    "host": "--host",
    "port": "--port",
    "priority_port": "--priority-port",
    "http_port": "--http-port",
    "max_batch_size": "--max-batch-size",
    "batch_cap": "--batch-cap",
    "memory_limit": "--memory-limit",
    "host_memory_limit": "--host-memory-limit",
    "device": "--device",
    "drain_grace_s": "--drain-grace-s",
    "drain_delay_s": "--drain-delay-s",
    "max_message_bytes": "--max-message-bytes",
    "max_concurrent_rpcs": "--max-concurrent-rpcs",
    "max_pending_calls": "--max-pending-calls",
    "priority_max_pending_calls": "--priority-max-pending-calls",
    "intra_op_threads": "--intra-op-threads",
    "metrics_port": "--metrics-port",
    "tls_cert": "--tls-cert",
    "tls_key": "--tls-key",
    "tls_client_ca": "--tls-client-ca",
    "probe_shapes": "--probe-shape",
    "shared_memory": "--shared-memory",
}


def _serve_config(args: argparse.Namespace) -> tuple[ServerConfig, dict[str, str]]:
    """The config file (--config), `serve`'s flags over it; and the flag that gave each
    setting a flag gave ("server.port": "--port"), by which a refusal of its value is
    named (`_named_by_flags`): the file's values, by their keys."""
    overrides: dict[str, Any] = {
        key: getattr(args, flag.removeprefix("--").replace("-", "_"))
        for key, flag in _SERVE_FLAGS.items()
    }
    overrides["probe_shapes"] = _probe_shapes(overrides["probe_shapes"])
    # A flag's value replaced the file's (None: not given), so it is the one refused.
    flags = {
        f"server.{key}": flag for key, flag in _SERVE_FLAGS.items() if overrides[key] is not None
    }
    with _named_by_flags(flags):
        config = load_config(args.config, model_path=args.model, overrides=overrides)
    if set(config.probe_shapes) != set(overrides["probe_shapes"] or ()):
        # Merged with the file's by input: an input refused may be the file's. (The
        # config refuses server.probe_shapes unkeyed: `_probe_shapes` checks the flag's.)
        flags.pop("server.probe_shapes", None)
    return config, flags


@contextlib.contextmanager
def _named_by_flags(flags: Mapping[str, str]) -> Iterator[None]:
    """A ConfigError raised within, each setting it names that a flag gave (`flags`)
    named by that flag (`ConfigError.naming_flags`): `--max-batch-size 0` was refused as
    server.max_batch_size, a key its user never wrote, and so were a busy `--port` and
    an unreadable `--tls-cert`, refused as the server started."""
    try:
        yield
    except ConfigError as error:
        raise error.naming_flags(flags) from error


def _unset_blank_otel_variables() -> None:
    """An OTEL_* variable set to nothing is unset, as the specification reads it
    (deployment templates write `${X:-}`): the SDK warned of an empty sampler or batch
    setting and took its default, which the tracing check refuses as a setting it could
    not take."""
    for name in [
        n for n, value in os.environ.items() if n.startswith("OTEL_") and not value.strip()
    ]:
        del os.environ[name]


# What a start-up error out of file descriptors adds: the OSError named neither what ran
# out nor what to raise (the static estimate's pipe, a port's socket).
_FILE_LIMIT_HINTS = {
    errno.EMFILE: OPEN_FILES_HINT,
    errno.ENFILE: "the system's open-file table is full (see fs.file-max)",
}


def _start_failure(error: Exception) -> str:
    """What a start-up error says: its own words, and a hint where they give none."""
    hint = _FILE_LIMIT_HINTS.get(error.errno or 0) if isinstance(error, OSError) else None
    return str(error) if hint is None else f"{error}; {hint}"


def _start_again_without_grpc_core_lines() -> None:
    """With JSON logs every stderr line must be a JSON object, but gRPC's C core writes
    lines of its own there ("E1203 ... add_port.cc:83] Failed to add port ...": laneserve's
    startup_failed line says the same). The core reads GRPC_VERBOSITY once, when grpc's
    extension module loads, which this module's imports have done: the process starts
    again (exec: the same pid, arguments and streams) with GRPC_VERBOSITY=NONE, before it
    has logged or bound anything. A GRPC_VERBOSITY already set is the operator's choice
    (debugging the core, whose lines are not JSON): it is kept, and nothing restarts.
    The stop signals are blocked across the exec (the mask is inherited): one sent
    meanwhile waits for the new process's first handler (`catch_stop_signals_early`)
    instead of meeting none, which as PID 1 ignored it."""
    if "GRPC_VERBOSITY" in os.environ or not sys.executable:
        return
    os.environ["GRPC_VERBOSITY"] = "NONE"  # exec passes os.environ on
    # A stream is None where the process started with its fd closed (some daemonisers
    # do), and one whose reader is gone cannot be flushed: neither stops the start.
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.flush()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        os.execv(sys.executable, sys.orig_argv)  # noqa: S606 - this process's own command line
    finally:  # reached only where the exec failed
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _make_model(path: str, *, seed: int) -> int:
    """`laneserve make-model`: 0 once written; 2, with one line, where it cannot be."""
    from laneserve.server.demo_model import make_demo_model  # noqa: PLC0415 - needs onnx

    problem = _unwritable_file(Path(path))
    if problem is None:
        try:
            make_demo_model(path, seed=seed)
        except OSError as error:  # what the checks cannot see: permissions, a full disk
            problem = (
                f"cannot write {error.filename or path}: {error.strerror}; expected a path "
                "this user may write"
            )
    if problem is not None:
        print(f"laneserve: make-model {path}: {problem}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def _unwritable_file(target: Path) -> str | None:
    """Why no file can be written at `target`, and what was expected; None when nothing
    in the way is seen. Checked first: the OS's own errors name the wrong path (a file in
    the way of a directory to create reads "File exists")."""
    if target.is_dir():
        return "is a directory; expected the path of the file to write (e.g. models/demo.onnx)"
    # The nearest parent that exists must be a directory: the missing ones are created.
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                return (
                    f"{parent} is not a directory; expected a path whose existing "
                    "parents are directories (missing ones are created)"
                )
            break
    return None


def _probe_shapes(flags: Sequence[str] | None) -> dict[str, list[int]] | None:
    """--probe-shape NAME=D1,D2,... (repeated) as server.probe_shapes; None: not given.
    Its sizes are checked here, as server.probe_shapes checks them: refused there, a size
    of 0 was named by that key, which its user never wrote."""
    if not flags:
        return None
    shapes: dict[str, list[int]] = {}
    given: dict[str, str] = {}  # input -> the flag that gave its shape
    for flag in flags:
        name, _, dims = flag.partition("=")
        try:
            sizes = [int(dim) for dim in dims.split(",")]
        except ValueError:  # no "=", an empty size, or one that is not a number
            sizes = []
        if not name or not sizes or not all(1 <= size <= UINT32_MAX for size in sizes):
            raise ConfigError(
                f"--probe-shape: expected NAME=D1,D2,... (an input and its sizes after the "
                f"row axis, each in [1, {UINT32_MAX}], e.g. image=3,224,224), got {flag!r}"
            )
        if name in given:
            # The probe runs one shape per input: a later flag replaced an earlier one
            # unsaid (sequence lengths 128, 256 and 512 were probed at 512 alone).
            raise ConfigError(
                f"--probe-shape: input {name!r} is given twice ({given[name]!r} and "
                f"{flag!r}); expected one shape per input"
            )
        given[name] = flag
        shapes[name] = sizes
    return shapes


async def _serve(config: ServerConfig) -> tuple[int, bool]:
    """Serves until a signal (or a failure); the exit code, and whether every thread of
    the server ended."""
    # The handlers come first, and the model loads and is probed on a thread, so that
    # the loop takes signals meanwhile (minutes, for a large model on a GPU): a SIGTERM
    # then means "do not serve", a second one "exit now" (nothing is served yet), never
    # the default action nor a wait for the load.
    loop = asyncio.get_running_loop()
    stopper = _Stopper()
    for signum in stop_signals_taken():
        loop.add_signal_handler(signum, stopper.on_signal, signum)
    # In milliseconds, not after the model has loaded (minutes, for a large one):
    check_open_file_limit()
    check_ports_free(config)
    server_credentials(config)  # the TLS files read and checked; read again to serve
    _unset_blank_otel_variables()
    check_tracing_env()  # the OTEL_* variables tracing reads; read again to serve
    _log_loading(config.model_path)
    loaded = await asyncio.to_thread(_load_server, config, stopper.stopping)
    if loaded is None or stopper.asked.is_set():  # asked while it loaded: it never serves
        if loaded is not None:
            await loaded.stop()
        log_event(log, logging.INFO, "shutdown", "stopped before serving", drained=True)
        return 0, True
    stopper.attach(loaded)
    await loaded.start()
    tune_for_serving()
    await stopper.stop_when_asked()
    return (0 if loaded.failure is None else 1), loaded.threads_stopped


class _Stopper:
    """What `serve` does on each stop signal (`on_signal`), from the start to the end of
    its drain. Before it serves, see `_signal_while_starting`. Once it serves, the first
    signal stops it (`stop_when_asked`): where `drain_delay_s` is set, health NOT_SERVING
    while it serves on that long; then a drain within `drain_grace_s`. A later signal
    (not the first one again within REPEAT_WINDOW_S: that is the same request delivered
    twice) means "stop now" wherever it comes, in the delay as in the drain: what is
    queued is answered UNAVAILABLE at once. One meaning for a second signal throughout
    (a second Ctrl-C, a supervisor's second SIGTERM): a drain after the rest of the delay
    would have asked for a third. Only the event loop touches it.

    `clock` times the signals; `wait_s` waits out the drain delay (a test passes one it
    ends by hand)."""

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        wait_s: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        self._signals = StopSignals(clock or SystemClock())
        self._wait_s = wait_s
        self.asked = asyncio.Event()  # the first signal came
        # The same, for the loading thread: its probe stops at the next batch size.
        self.stopping = threading.Event()
        self._now = asyncio.Event()  # a later one: no more waiting, for the delay or grace
        self._first_name = ""  # the first signal's, once one came while serving
        self._server: LaneServer | None = None  # once it starts to serve

    def attach(self, server: LaneServer) -> None:
        """`server`, loaded, is about to start: a signal from now on stops it."""
        self._server = server

    def on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        meaning = self._signals.meaning(signum)
        if meaning is SignalMeaning.REPEAT:
            log_event(
                log,
                logging.INFO,
                "signal_repeated",
                f"{name} again within {REPEAT_WINDOW_S:g}s: taken as the same request (a "
                f"wrapper's forwarded copy, or pressed twice quickly); {name} again later "
                "stops at once",
                signal=name,
            )
            return
        # Set before any line below is logged: the log's own thread may write a line
        # before this one runs on, and the loading thread's probe checks `stopping`
        # before each batch size. Set after "while starting" (which says no further
        # size is timed), a size could begin once that line was out.
        self.stopping.set()
        server = self._server
        if server is None:
            _signal_while_starting(name, signum, again=meaning is SignalMeaning.STOP_NOW)
        elif meaning is SignalMeaning.STOP:
            self._first_name = name
            if server.config.drain_delay_s > 0:
                log_event(
                    log,
                    logging.INFO,
                    "drain_delayed",
                    f"{name}: health NOT_SERVING; serving {server.config.drain_delay_s:g}s "
                    f"more, for load balancers to stop sending, then draining (grace "
                    f"{server.config.drain_grace_s:g}s)",
                    signal=name,
                    delay_s=server.config.drain_delay_s,
                    grace_s=server.config.drain_grace_s,
                )
            else:
                self._log_drain_started(server)
        else:  # delaying the drain, draining, or about to: no more waiting either way
            log_event(
                log,
                logging.WARNING,
                "drain_cut_short",
                f"{name} again: ending the drain now; what is queued gets UNAVAILABLE",
                signal=name,
            )
            server.end_grace()
            self._now.set()
        self.asked.set()

    async def stop_when_asked(self) -> None:
        """Waits for the first signal (or for the server to stop itself: its scheduler
        failed), then stops the server: after the drain delay, a drain."""
        server = self._server
        assert server is not None, "attach(server) first"
        asked = asyncio.ensure_future(self.asked.wait())
        stopped = asyncio.ensure_future(server.wait_stopped())
        await asyncio.wait((asked, stopped), return_when=asyncio.FIRST_COMPLETED)
        asked.cancel()
        if not stopped.done() and server.config.drain_delay_s > 0:
            await self._delay_drain(server, stopped)
        stopped.cancel()
        await server.stop()

    async def _delay_drain(self, server: LaneServer, stopped: asyncio.Future[None]) -> None:
        """Health NOT_SERVING while the server admits and serves on, for `drain_delay_s`:
        health checks every second or so take that long to send callers elsewhere, and
        a drain at the signal refused their calls meanwhile. Ends early at a later
        signal, or when the server stops itself."""
        await server.announce_not_serving()
        waited = asyncio.ensure_future(self._wait_s(server.config.drain_delay_s))
        now = asyncio.ensure_future(self._now.wait())
        await asyncio.wait((waited, now, stopped), return_when=asyncio.FIRST_COMPLETED)
        waited.cancel()
        now.cancel()
        if not self._now.is_set() and not stopped.done():
            self._log_drain_started(server)

    def _log_drain_started(self, server: LaneServer) -> None:
        log_event(
            log,
            logging.INFO,
            "drain_started",
            f"{self._first_name}: draining (grace {server.config.drain_grace_s:g}s)",
            signal=self._first_name,
            grace_s=server.config.drain_grace_s,
        )


def _log_loading(model_path: str) -> None:
    """Says the load begins, and how large the model's file is (its external data files
    apart: counting them means parsing the graph): the log said nothing more for the tens
    of seconds a large model takes to load and probe."""
    try:
        status = Path(model_path).stat()
    except OSError:  # the load says why it cannot read it, in one line
        return
    if not stat.S_ISREG(status.st_mode):  # a directory, say: refused at once, as above
        return
    log_event(
        log,
        logging.INFO,
        "loading",
        f"loading {model_path} (its file {format_bytes(status.st_size)}, external data apart)",
        model=model_path,
        file_bytes=status.st_size,
    )


def _load_server(config: ServerConfig, stopping: threading.Event) -> LaneServer | None:
    """The server, its model loaded and probed: run on a thread (see `_serve`); None
    where `stopping` was set (a stop signal) before its probe was done: the probe timed
    no further batch size, and nothing is to be served. Whatever it raises must reach
    the awaiting future, and asyncio cannot put a StopIteration into one ("cannot be
    raised into a Future"): the future never finished and the start hung for good, a
    SIGTERM only saying it would stop once the model had loaded. A StopIteration out of
    the load is a bug; it ends the start as one (a RuntimeError)."""
    try:
        return LaneServer(load_engine(config), config, stopping=stopping)
    except ProbeStopped:
        return None
    except StopIteration as error:
        raise RuntimeError(
            "loading the model raised StopIteration, a bug in laneserve (its traceback "
            "is above); expected a loaded server or a start-up error"
        ) from error


def _signal_while_starting(name: str, signum: int, *, again: bool) -> None:
    """A signal before the server serves: the first ends the static estimate's child (its
    answer would go unused) and stops the server once the model's session is made (its
    making cannot be interrupted) and the probe's batch size then running is done (it
    times no other); the next (not the first again
    within REPEAT_WINDOW_S, see `_Stopper`) ends the process at once, by that signal
    (`die_by_signal`): nothing is served to lose. Its static estimate's child is ended
    first: orphaned, it ran on, parsing the model (up to 120 s, GBs resident)."""
    if not again:
        log_event(
            log,
            logging.INFO,
            "stop_while_starting",
            f"{name} while starting: stopping once the model's session is made (the "
            f"start-up probe times no further batch size), without serving ({name} again "
            f"exits now; within {REPEAT_WINDOW_S:g}s it counts as this one)",
            signal=name,
        )
        stop_estimates()
        return
    log_event(log, logging.WARNING, "exit_while_starting", f"{name} again: exiting", signal=name)
    stop_estimates()
    logging.shutdown()
    die_by_signal(signum)


def _asked_log_format(argv: Sequence[str] | None) -> str | None:
    """The last --log-format on the command line, read before the whole of it is parsed
    (None: not given, or given no value), so that a refusal of the rest is written in it."""
    probe = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    probe.add_argument("--log-format")
    try:
        known, _rest = probe.parse_known_args(argv)
    except argparse.ArgumentError:  # --log-format without a value: the full parse says so
        return None
    log_format: str | None = known.log_format
    return log_format


def _parser(*, json_errors: bool = False) -> argparse.ArgumentParser:
    """The command line's parser; with `json_errors`, a refusal of the command line is one
    JSON log line (`usage_error`), not argparse's text: log shippers parse every line."""

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> NoReturn:
            if not json_errors:
                super().error(message)
            configure_logging("info", json_lines=True)
            refuse_usage(log, f"{self.prog}: {message}", json_lines=True)
            sys.exit(2)

    parser = Parser(prog="laneserve", description=__doc__)
    _add_log_arguments(parser, level="info", log_format="text")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve an ONNX model over gRPC")
    # After `serve` too: ./scripts/serve passes its arguments after it. Not given there,
    # they leave what was given before `serve` (or its default) as it is.
    _add_log_arguments(serve, level=argparse.SUPPRESS, log_format=argparse.SUPPRESS)
    serve.add_argument("--model", required=True, help="path of the ONNX model")
    serve.add_argument(
        "--model-name",
        help="the model's name to KServe v2 / Triton clients (default: the model file's "
        "name without its suffix)",
    )
    serve.add_argument("--config", help="TOML file with [server] settings and [[lanes]]")
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default 50051; 0 = any)")
    serve.add_argument(
        "--priority-port",
        type=int,
        help="a second port for latency-critical callers, with its own queue in gRPC's "
        "core in front of the same lanes (0 = any, -1 = none; default none)",
    )
    serve.add_argument(
        "--http-port",
        type=int,
        help="KServe v2 / Triton HTTP/REST on --host, in front of the same lanes (0 = any, "
        "-1 = none; default none; README, HTTP)",
    )
    serve.add_argument(
        "--max-batch-size", type=int, help="upper bound of rows per batch (default 128)"
    )
    serve.add_argument(
        "--batch-cap", type=int, help="fix the batch cap instead of probing memory for it"
    )
    serve.add_argument(
        "--memory-limit",
        help="hard limit on device memory: bytes (6GiB) or a fraction (0.9; default on a GPU)",
    )
    serve.add_argument(
        "--host-memory-limit",
        help="CPU only: resident memory the admission watermarks refer to (e.g. 8GiB; "
        "default: the cgroup's memory limit, if any)",
    )
    serve.add_argument("--device", choices=DEVICES, help="execution device (default auto)")
    serve.add_argument(
        "--drain-grace-s",
        type=float,
        help="seconds queued work may finish on SIGTERM (default 10, at most 3600)",
    )
    serve.add_argument(
        "--drain-delay-s",
        type=float,
        help="seconds a SIGTERM leaves it serving, health NOT_SERVING, before the drain "
        "(default 0)",
    )
    serve.add_argument(
        "--max-message-bytes",
        type=int,
        help="message size limit of the gRPC and HTTP ports (default 64 MiB, at least 1024)",
    )
    serve.add_argument(
        "--max-concurrent-rpcs",
        type=int,
        help="inference calls in progress per port at once (default 4096)",
    )
    serve.add_argument(
        "--max-pending-calls",
        type=int,
        help="calls gRPC's core holds before the event loop takes them; beyond 3/4 of it "
        "it refuses some, at it all (default 256)",
    )
    serve.add_argument(
        "--priority-max-pending-calls",
        type=int,
        help="the same for the priority port's own queue (default 24: its callers wait on "
        "deadlines, so it is kept short in time)",
    )
    serve.add_argument("--tls-cert", help="PEM certificate (chain): the port speaks TLS")
    serve.add_argument("--tls-key", help="PEM private key of --tls-cert")
    serve.add_argument(
        "--tls-client-ca", help="PEM CA: clients must present a certificate it signed (mTLS)"
    )
    serve.add_argument(
        "--probe-shape",
        action="append",
        metavar="NAME=D1,D2,...",
        help="an input's sizes after the row axis for the start-up probe, when its dynamic "
        "dimensions cannot be 1 (e.g. image=3,224,224); repeat per input",
    )
    serve.add_argument(
        "--intra-op-threads",
        type=int,
        help="ONNX Runtime threads (0 = auto: on the CPU the cores, capped by the "
        "cgroup's CPU quota, less 1)",
    )
    serve.add_argument(
        "--shared-memory",
        action=argparse.BooleanOptionalAction,
        help="let KServe / Triton callers on this host (loopback) pass tensors "
        "through POSIX shared memory (default off; README, Shared memory)",
    )
    serve.add_argument(
        "--metrics-port",
        type=int,
        help="Prometheus endpoint on --host (default 9464; 0 = any free port; -1 = none)",
    )
    top = commands.add_parser("top", help="a live dashboard of a server's GetStats (any target)")
    add_top_arguments(top)
    bench = commands.add_parser(
        "bench", help="benchmark against the naive designs (bench/README.md)"
    )
    bench_cli.add_arguments(bench)
    make = commands.add_parser("make-model", help="write the demo MLP model")
    # The log settings after `top` and `make-model` as after `serve` (`laneserve top
    # --log-format json` was refused as an unknown argument); `bench` has its own.
    for command in (top, make):
        _add_log_arguments(command, level=argparse.SUPPRESS, log_format=argparse.SUPPRESS)
    make.add_argument("path")
    make.add_argument(
        "--seed", type=flag_values.integer(0), default=0, help="seed of the weights (default 0)"
    )
    return parser


def _add_log_arguments(parser: argparse.ArgumentParser, *, level: str, log_format: str) -> None:
    parser.add_argument("--log-level", default=level, choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--log-format",
        default=log_format,
        choices=["text", "json"],
        help="one line per event: text with key=value fields, or one JSON object",
    )
