"""Sampling the server under load with py-spy (optional: `pip install py-spy`), and the
summary of its collapsed stacks: where the server's threads spend their CPU time."""

from __future__ import annotations

import collections
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Final

TOP_FRAMES: Final = 15
STOP_TIMEOUT_S: Final = 60.0
# "name (path:line)" -> "name (path)": lines of one function are added up.
_LINE = re.compile(r":\d+\)$")


def py_spy_binary() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


class PySpy:
    """`py-spy record` attached to one process until `stop`; raw collapsed stacks, one
    root frame per thread, idle samples left out (so the counts are CPU time)."""

    def __init__(self, binary: str, pid: int, output: Path, *, rate_hz: int = 250) -> None:
        self.output = output
        self.process = subprocess.Popen(  # noqa: S603 - argv is built here, never from input
            [
                binary,
                "record",
                "--pid",
                str(pid),
                "--rate",
                str(rate_hz),
                "--format",
                "raw",
                "--threads",
                "--nonblocking",
                "--output",
                str(output),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> dict[str, Any]:
        """Ends the recording (SIGINT makes py-spy write its file) and summarizes it."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            _, errors = self.process.communicate(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, errors = self.process.communicate()
        if not self.output.exists():
            return {"error": f"py-spy wrote nothing (exit {self.process.returncode}): {errors}"}
        return summarize_collapsed(self.output.read_text(encoding="utf-8"))


def summarize_collapsed(text: str) -> dict[str, Any]:
    """Samples by thread, and the functions with most samples on top of the stack (self)
    and anywhere in it (inclusive), as fractions of all samples."""
    total = 0
    by_thread: collections.Counter[str] = collections.Counter()
    self_time: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = stack.split(";")
        thread = frames[0] if frames[0].startswith(("thread", "process")) else "?"
        if thread != "?":
            frames = frames[1:]
        by_thread[thread] += count
        functions = [_LINE.sub(")", frame) for frame in frames]
        if functions:
            self_time[functions[-1]] += count
        for function in set(functions):
            inclusive[function] += count

    def top(counter: collections.Counter[str]) -> list[dict[str, Any]]:
        return [
            {"frame": frame, "samples": count, "fraction": count / total}
            for frame, count in counter.most_common(TOP_FRAMES)
        ]

    # Inclusive time is told only for the project's own functions: the frames above
    # them (thread bootstrap, the event loop) include everything and say nothing.
    ours = collections.Counter(
        {frame: count for frame, count in inclusive.items() if _is_project_frame(frame)}
    )

    return {
        "samples": total,
        "by_thread": {thread: count / total for thread, count in by_thread.most_common()}
        if total
        else {},
        "top_self": top(self_time) if total else [],
        "top_inclusive": top(ours) if total else [],
    }


def _is_project_frame(frame: str) -> bool:
    """Frames look like "name (path)"; the project's paths start with its folders (as
    py-spy shortens them) or contain the installed package's name."""
    path = frame.rpartition("(")[2]
    return path.startswith(("server/", "client/", "protos/")) or "laneserve/" in path
