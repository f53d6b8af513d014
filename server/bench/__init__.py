"""The benchmark harness: laneserve against the naive designs and the raw session
ceiling, side by side in one run (issue 6). Results go to bench/results/; the method and
the last figures are in bench/README.md.

Modules, in the order a run uses them: settings (streams, points, profiles) -> procs
(servers under test as processes) and baselines (the naive servers and the raw ceiling)
-> loadgen (client processes) -> summary (figures from records) -> run (the
orchestrator) -> report (targets, JSON, Markdown, plots); profiling wraps py-spy; cli is
`laneserve bench`.
"""

from laneserve.server.bench.cli import main
from laneserve.server.bench.report import evaluate_targets, missing_keys, write_outputs
from laneserve.server.bench.run import BenchSettings, run_bench
from laneserve.server.bench.settings import PROFILES, Point, Profile, Stream

__all__ = [
    "PROFILES",
    "BenchSettings",
    "Point",
    "Profile",
    "Stream",
    "evaluate_targets",
    "main",
    "missing_keys",
    "run_bench",
    "write_outputs",
]
