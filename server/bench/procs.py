"""Servers under test as processes of their own, started and stopped by the harness.

Each server runs in its own process, so it never shares the load generator's GIL. Its
port is read from its log line ``serving ... on HOST:PORT`` (every server here binds
port 0 or a port chosen by the first of a group). Memory is measured two ways at one
instant over a configuration's processes, and each one's peak is the largest figure the
orchestrator sampled while the load ran:

- *unique* (the verdicts' measure): each resident page of the configuration counted once,
  from ``/proc/PID/smaps`` (`unique_memory`): every process's private pages, plus each
  file mapping's shared pages once, however many of the processes map it.
- PSS (``Pss`` in ``/proc/PID/smaps_rollup``), summed: each shared page divided among
  *all* the processes that map it, the harness's own among them (its load generators map
  the same Python, numpy and gRPC libraries), so it understates a configuration, one
  process by more than N.

Where smaps_rollup cannot be read, the resident set (``VmRSS``) stands in for PSS, and the
figures say so; where smaps cannot be read, there is no unique figure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from laneserve.server.addresses import bare_host

log = logging.getLogger(__name__)

READY_PATTERN: Final = re.compile(r"serving .* on ([0-9.]+|\[[0-9a-f:]+\]|localhost):(\d+)")
# laneserve's line goes on with this when it serves a priority port too.
PRIORITY_PATTERN: Final = re.compile(r"priority port (\d+)")
HTTP_PATTERN: Final = re.compile(r"HTTP port (\d+)")  # and with --http-port, this
START_TIMEOUT_S: Final = 120.0
STOP_TIMEOUT_S: Final = 20.0
LOG_TAIL_LINES: Final = 40


class StartError(RuntimeError):
    """A server under test did not come up; the message carries the end of its log."""


class ServerError(RuntimeError):
    """A server under test stopped answering while the load ran (it exited, or its
    GetStats failed): the run ends there, having stopped every process it started."""


class ServerProcess:
    """One server process; its stderr is read by a thread so the pipe never fills."""

    def __init__(self, name: str, argv: Sequence[str]) -> None:
        self.name = name
        self.argv = list(argv)
        self._lines: queue.Queue[str] = queue.Queue()
        self._tail: list[str] = []
        # The priority port its ready line names, if any (laneserve --priority-port).
        self.priority_port: int | None = None
        # The HTTP port its ready line names, if any (laneserve --http-port).
        self.http_port: int | None = None
        self.process = subprocess.Popen(  # noqa: S603 - argv is built here, never from input
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._reader = threading.Thread(
            target=self._read, name=f"laneserve-bench-log-{name}", daemon=True
        )
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self._lines.put(line)
        self._lines.put("")  # end of output: the process has exited

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> tuple[str, int]:
        """(host, port) from the server's `serving ... on HOST:PORT` line."""
        while True:
            try:
                line = self._lines.get(timeout=timeout_s)
            except queue.Empty:
                raise StartError(
                    f"{self.name} did not log 'serving ... on HOST:PORT' within {timeout_s:.0f}s;"
                    f" log so far:\n{self.log_tail()}"
                ) from None
            self._remember(line)
            if not line:
                code = self.process.wait()
                raise StartError(
                    f"{self.name} exited with status {code} before serving; its log:\n"
                    f"{self.log_tail()}"
                )
            match = READY_PATTERN.search(line)
            if match:
                priority = PRIORITY_PATTERN.search(line, match.end())
                self.priority_port = None if priority is None else int(priority.group(1))
                http = HTTP_PATTERN.search(line, match.end())
                self.http_port = None if http is None else int(http.group(1))
                return bare_host(match.group(1)), int(match.group(2))

    def _remember(self, line: str) -> None:
        self._tail.append(line)
        del self._tail[:-LOG_TAIL_LINES]

    def log_tail(self) -> str:
        while True:
            try:
                self._remember(self._lines.get_nowait())
            except queue.Empty:
                return "".join(self._tail)

    def memory(self) -> ProcessMemory:
        return read_process_memory(self.pid)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM (the servers drain and exit 0), then SIGKILL after `timeout_s`; with
        `timeout_s` 0, SIGKILL at once."""
        if self.process.poll() is None:
            if timeout_s > 0:
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                if timeout_s > 0:
                    log.warning("%s did not stop within %.0fs; killing it", self.name, timeout_s)
                self.process.kill()
                self.process.wait()
        self._reader.join(timeout=max(timeout_s, 1.0))
        assert self.process.stderr is not None
        self.process.stderr.close()
        return self.process.returncode


# A file mapping by what it maps, as smaps writes it: (device, inode, offset into the
# file). Every process mapping that part of that file sees the same page-cache pages,
# whatever the path says (a deleted or replaced file keeps its inode; a path may not).
MappingKey = tuple[str, str, str]


@dataclasses.dataclass(frozen=True, slots=True)
class ResidentPages:
    """One process's resident pages (/proc/PID/smaps), split so that the pages a
    configuration's processes share can be counted once (`unique_memory`)."""

    # Pages counted to this process alone, in bytes: its private pages (Private_Clean +
    # Private_Dirty of every mapping) and the shared pages of its anonymous mappings.
    own_bytes: int
    # Per file mapping: its shared resident pages (Shared_Clean + Shared_Dirty), in bytes.
    # Shared with any process, the harness's own included.
    shared_bytes: dict[MappingKey, int]


_PRIVATE_FIELDS: Final = frozenset({"Private_Clean", "Private_Dirty"})
_SHARED_FIELDS: Final = frozenset({"Shared_Clean", "Shared_Dirty"})
# A mapping's header line ("start-end perms offset dev inode path") starts with a
# lower-case hex digit; its field lines ("Rss:  8 kB") with an upper-case letter.
_HEADER_STARTS: Final = frozenset("0123456789abcdef")


def read_resident_pages(path: Path) -> ResidentPages | None:
    """A process's pages from its smaps file; None when it cannot be read (the process
    is gone, or another user's). One pass over the lines, no regular expressions: it runs
    on the orchestrator's thread at every window boundary, over thousands of lines."""
    try:
        text = path.read_text(encoding="ascii", errors="replace")  # paths are not used
    except OSError:
        return None
    own_kb = 0
    shared_kb: dict[MappingKey, int] = {}
    key: MappingKey | None = None  # None: the current mapping is anonymous
    for line in text.splitlines():
        if line[:1] in _HEADER_STARTS:
            fields = line.split(maxsplit=5)
            # Inode 0: anonymous ([heap], [stack], malloc arenas, ...). Its shared pages are
            # copy-on-write ones shared with a fork() relative, and the processes of a
            # configuration are exec()'d apart, never forks of one another: none of them
            # can hold another's anonymous page, so each counts its own. (Keying them by
            # address would merge unrelated pages that sit at one address in two
            # processes.) Shared anonymous memory (shmem, memfd) has an inode: keyed below.
            key = None if fields[4] == "0" else (fields[3], fields[4], fields[2])
            continue
        name, _, value = line.partition(":")
        if name in _PRIVATE_FIELDS:
            own_kb += int(value.split()[0])
        elif name in _SHARED_FIELDS:
            kb = int(value.split()[0])
            if key is None:
                own_kb += kb
            elif kb:
                shared_kb[key] = shared_kb.get(key, 0) + kb
    return ResidentPages(
        own_bytes=own_kb * 1024,
        shared_bytes={key: kb * 1024 for key, kb in shared_kb.items()},
    )


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessMemory:
    """One reading of one process's memory, in bytes (None: could not be read)."""

    pid: int
    # Proportional set size (smaps_rollup): shared pages divided among their users.
    pss_bytes: int | None
    # Resident set (status VmRSS) and its high-water mark (VmHWM), this process alone.
    rss_bytes: int | None
    peak_rss_bytes: int | None
    # Its resident pages by mapping (smaps), for `unique_memory`.
    pages: ResidentPages | None = dataclasses.field(default=None, repr=False)


def read_process_memory(pid: int, proc: Path = Path("/proc")) -> ProcessMemory:
    status = _kb_fields(proc / str(pid) / "status")
    rollup = _kb_fields(proc / str(pid) / "smaps_rollup")
    return ProcessMemory(
        pid=pid,
        pss_bytes=rollup.get("Pss"),
        rss_bytes=status.get("VmRSS"),
        peak_rss_bytes=status.get("VmHWM"),
        pages=read_resident_pages(proc / str(pid) / "smaps"),
    )


# Which measure a configuration's memory figures are.
UNIQUE: Final = "unique"
UNIQUE_DESCRIPTION: Final = "each resident page of the configuration's processes counted once"
PSS: Final = "PSS"
RSS: Final = "RSS"
RSS_NOTE: Final = (
    "/proc/PID/smaps_rollup could not be read for every process: the resident set (VmRSS) "
    "is summed instead, which counts pages shared between the processes once per process"
)


def summed_memory(readings: Sequence[ProcessMemory]) -> tuple[str | None, int | None]:
    """(measure, bytes) of processes read at one instant: their PSS summed, or where any
    PSS is unknown their RSS summed; (None, None) when neither is known for all."""
    if not readings:
        return None, None
    pss = [reading.pss_bytes for reading in readings]
    if all(value is not None for value in pss):
        return PSS, sum(value for value in pss if value is not None)
    rss = [reading.rss_bytes for reading in readings]
    if all(value is not None for value in rss):
        return RSS, sum(value for value in rss if value is not None)
    return None, None


def unique_memory(readings: Sequence[ProcessMemory]) -> int | None:
    """Bytes of the processes' resident pages with each page counted once: every
    process's own pages, plus for each file mapping the most shared pages any of them has
    resident in it. None when any process's smaps was not read.

    Per mapping, not per page (that needs /proc/PID/pagemap, root only): the largest of
    the processes' resident shares stands for their union, which it undercounts only where
    they hold different parts of a mapping resident; and a file range two processes map
    in differently split mappings counts twice. Shared libraries, mapped alike by the same
    loader, are neither."""
    pages = [reading.pages for reading in readings if reading.pages is not None]
    if not readings or len(pages) < len(readings):
        return None
    shared: dict[MappingKey, int] = {}
    for process in pages:
        for key, size in process.shared_bytes.items():
            shared[key] = max(size, shared.get(key, 0))
    return sum(process.own_bytes for process in pages) + sum(shared.values())


def _kb_fields(path: Path) -> dict[str, int]:
    """The kB fields of a /proc file (status, smaps_rollup), in bytes; empty when the
    process is gone, the file is not readable or the system has no /proc."""
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        return {}
    fields: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":  # noqa: PLR2004 - "<number> kB"
            fields[key] = int(parts[0]) * 1024
    return fields


_TICKS_PER_S: Final = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) the process has used; None once gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
    except OSError:
        return None
    # "pid (comm) state ppid ...": utime and stime are fields 14 and 15, counted from 1;
    # comm may hold spaces, so count from the ")" that ends it.
    fields = stat.rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def thread_cpu_s(pid: int) -> dict[int, tuple[str, float]]:
    """Per thread of the process: its name and the CPU seconds it has used. Native
    threads (ONNX Runtime's pool, gRPC's pollers) are there too, unlike in a Python
    profiler's view."""
    threads: dict[int, tuple[str, float]] = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return threads
    for task in tasks:
        try:
            name = (task / "comm").read_text(encoding="utf-8").strip()
            fields = (task / "stat").read_text(encoding="ascii").rpartition(")")[2].split()
        except OSError:
            continue  # the thread ended meanwhile
        threads[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / _TICKS_PER_S)
    return threads


def machine_busy_s() -> float | None:
    """CPU seconds all cores of the machine have spent busy (not idle, not waiting on
    I/O) since boot; None without /proc."""
    try:
        line = Path("/proc/stat").read_text(encoding="ascii").splitlines()[0]
    except (OSError, IndexError):
        return None
    ticks = [int(value) for value in line.split()[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # noqa: PLR2004 - idle, iowait
    return (sum(ticks[:8]) - idle) / _TICKS_PER_S


@dataclasses.dataclass
class Deployment:
    """One configuration under test: its name, its address and the processes behind it
    (none for an endpoint the harness did not start)."""

    name: str
    kind: str
    target: str
    # HOST:PORT of the priority port (laneserve's second port), if it serves one.
    priority_target: str | None = None
    # HOST:PORT of the KServe v2 HTTP port, if it serves one.
    http_target: str | None = None
    processes: list[ServerProcess] = dataclasses.field(default_factory=list)
    # What the processes were started with, for the report.
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    # By measure (UNIQUE, and PSS or RSS), the largest memory sampled so far while load
    # ran, and how many samples were taken. Only the orchestrator's thread touches them.
    memory_peaks: dict[str, int] = dataclasses.field(default_factory=dict)
    memory_samples: int = 0

    def sample_memory(self) -> None:
        """Reads every process's memory now and keeps each measure's figure if it is the
        largest yet: called at every window boundary, while the load runs."""
        readings = [process.memory() for process in self.processes]
        figures = {UNIQUE: unique_memory(readings)}
        measure, total = summed_memory(readings)
        if measure is not None:
            figures[measure] = total
        known = {name: value for name, value in figures.items() if value is not None}
        if not known:
            return
        self.memory_samples += 1
        for name, value in known.items():
            self.memory_peaks[name] = max(value, self.memory_peaks.get(name, 0))

    def memory(self) -> dict[str, Any]:
        """The processes' memory now, and the largest figures sampled while the load ran
        (None without samples): see `memory_figures`."""
        readings = [process.memory() for process in self.processes]
        return memory_figures(readings, self.memory_peaks, self.memory_samples)

    def stop(self) -> list[int]:
        """Stops every process (all of them, even when one fails to stop); exit codes.
        A Ctrl-C (KeyboardInterrupt) meanwhile skips no process: the one being stopped and
        every one after it are killed at once, then the interrupt goes on."""
        codes = []
        interrupted: KeyboardInterrupt | None = None
        for process in self.processes:
            try:
                codes.append(process.stop(STOP_TIMEOUT_S if interrupted is None else 0.0))
            except KeyboardInterrupt as error:
                interrupted = interrupted or error
                with contextlib.suppress(Exception):
                    codes.append(process.stop(0.0))
            except Exception:  # the others must still be stopped
                log.exception("stopping %s failed", process.name)
        if interrupted is not None:
            raise interrupted
        return codes

    def cpu_s(self) -> float | None:
        """CPU seconds used so far by the processes, summed; None when unknown."""
        used = [process_cpu_s(process.pid) for process in self.processes]
        if not used or any(value is None for value in used):
            return None
        return sum(value for value in used if value is not None)


def memory_figures(
    readings: Sequence[ProcessMemory], peaks: dict[str, int], samples: int
) -> dict[str, Any]:
    """The memory entry of a configuration in the document: `readings` taken now, and
    the largest figures sampled while the load ran (`peaks`, by measure). `unique_...`
    is the measure the verdicts read; `measure` names the one of `bytes` and `peak_bytes`
    (PSS, or RSS where PSS could not be read, `note` saying why), kept beside it."""
    measure, total = summed_memory(readings)
    return {
        # Each resident page of the processes counted once (UNIQUE_DESCRIPTION), now and
        # the largest sampled at the window boundaries while the load ran.
        "unique_bytes": unique_memory(readings),
        "unique_peak_bytes": peaks.get(UNIQUE),
        "measure": measure,
        "note": RSS_NOTE if measure == RSS else None,
        "processes": len(readings),
        # Summed over the processes now (after the load).
        "bytes": total,
        # The largest sum sampled at the window boundaries while the load ran.
        "peak_bytes": peaks.get(measure) if measure is not None else None,
        "samples": samples,
        "by_process": [_process_figures(reading) for reading in readings],
    }


def _process_figures(reading: ProcessMemory) -> dict[str, Any]:
    pages = reading.pages
    return {
        "pid": reading.pid,
        "pss_bytes": reading.pss_bytes,
        "rss_bytes": reading.rss_bytes,
        "peak_rss_bytes": reading.peak_rss_bytes,
        # Pages counted to this process alone, and those it shares (with anyone) in file
        # mappings: what `unique_memory` adds up.
        "own_bytes": None if pages is None else pages.own_bytes,
        "shared_file_bytes": None if pages is None else sum(pages.shared_bytes.values()),
    }


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def start_group(
    name: str, kind: str, argv: Callable[[int], Sequence[str]], *, count: int = 1
) -> Deployment:
    """Starts `count` processes one after another, `argv(0)` first and then `argv(port)`
    with the port the first one bound (SO_REUSEPORT: they share it); each must serve
    before the next starts. Stops them all if any fails."""
    deployment = Deployment(name=name, kind=kind, target="")
    try:
        port = 0
        for index in range(count):
            process = ServerProcess(f"{name}[{index}]" if count > 1 else name, argv(port))
            deployment.processes.append(process)
            host, bound = process.wait_ready()
            if index == 0:
                deployment.target = f"{host}:{bound}"
                if process.priority_port is not None:
                    deployment.priority_target = f"{host}:{process.priority_port}"
                if process.http_port is not None:
                    deployment.http_target = f"{host}:{process.http_port}"
                port = bound
            elif bound != port:
                _refuse_port(process.name, bound, port)
    except BaseException:
        deployment.stop()
        raise
    return deployment


def _refuse_port(name: str, bound: int, expected: int) -> None:
    raise StartError(f"{name} bound port {bound}; expected the group's port {expected}")


def serve_arguments(model_path: str, max_batch_size: int, *, metrics_port: int) -> list[str]:
    """`python -m laneserve.server.cli`'s arguments for a benchmarked `serve`: loopback,
    any free port, a 2 s drain."""
    return [
        "--log-level",
        "info",
        "serve",
        "--model",
        model_path,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--max-batch-size",
        str(max_batch_size),
        "--drain-grace-s",
        "2",
        "--metrics-port",
        str(metrics_port),
    ]


def start_laneserve(
    model_path: str,
    *,
    max_batch_size: int,
    intra_op_threads: int,
    device: str,
    config_path: str | None = None,
    extra_args: Sequence[str] = (),
) -> Deployment:
    """`laneserve serve` as the benchmarks run it; `extra_args` go to `serve` last."""
    args = [
        # Metrics stay on, as served by default, on a free port: a fixed one may be taken.
        *serve_arguments(model_path, max_batch_size, metrics_port=0),
        "--intra-op-threads",
        str(intra_op_threads),
        "--device",
        device,
        # For (c): interactive calls on a port of their own, queued apart in gRPC's core.
        "--priority-port",
        "0",
    ]
    if config_path is not None:
        args += ["--config", config_path]
    args += extra_args
    deployment = start_group(
        "laneserve", "laneserve", lambda _port: python_module("laneserve.server.cli", *args)
    )
    deployment.settings = {
        "max_batch_size": max_batch_size,
        "intra_op_threads": intra_op_threads,
        "device": device,
        "config": config_path,
        "extra_args": list(extra_args),
    }
    return deployment


BASELINES_MODULE: Final = "laneserve.server.bench.baselines"


def start_echo(model_path: str, *, device: str) -> Deployment:
    argv = python_module(BASELINES_MODULE, "echo", "--model", model_path, "--device", device)
    return start_group("echo", "echo", lambda _port: argv)


def start_no_batching(
    model_path: str, *, threads: int, intra_op_threads: int, device: str
) -> Deployment:
    argv = python_module(
        BASELINES_MODULE,
        "single",
        "--model",
        model_path,
        "--threads",
        str(threads),
        "--intra-op-threads",
        str(intra_op_threads),
        "--device",
        device,
    )
    deployment = start_group("no-batching", "no-batching", lambda _port: argv)
    deployment.settings = {
        "threads": threads,
        "intra_op_threads": intra_op_threads,
        "device": device,
    }
    return deployment


def start_workers(
    model_path: str, *, workers: int, intra_op_threads: int, device: str
) -> Deployment:
    """N single-session servers on one port (SO_REUSEPORT): the first binds a free port,
    the others join it; the kernel spreads the clients' connections over them."""

    def argv(port: int) -> list[str]:
        return python_module(
            BASELINES_MODULE,
            "single",
            "--model",
            model_path,
            "--port",
            str(port),
            "--reuse-port",
            "--threads",
            "1",
            "--intra-op-threads",
            str(intra_op_threads),
            "--device",
            device,
        )

    deployment = start_group(f"workers-{workers}", "workers", argv, count=workers)
    deployment.settings = {
        "workers": workers,
        "threads_per_worker": 1,
        "intra_op_threads": intra_op_threads,
        "device": device,
    }
    return deployment


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, as the server's Engine counts
    them), not every core of the machine."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere all the cores
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def default_worker_threads(workers: int) -> int:
    """Intra-op threads per worker: the usable cores shared out, at least one each."""
    return max(1, usable_cores() // workers)
