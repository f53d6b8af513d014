"""The `laneserve` console script, and `python -m laneserve.server.cli` (which comes
here first): the stop signals are caught before anything heavy is imported, then the
command line runs (laneserve.server.cli).

Importing the CLI loads ONNX Runtime and gRPC, about a second (twice with JSON logs,
which start the process again). As PID 1 of a container a SIGTERM that came meanwhile
met no handler and was ignored, and the pod waited out its whole termination grace
period: here it ends the process at once (`catch_stop_signals_early`). This module
imports nothing but the standard library and laneserve.server.process.
"""

from __future__ import annotations

import sys

from laneserve.server.process import catch_stop_signals_early


def main() -> int:
    catch_stop_signals_early()
    from laneserve.server import cli  # noqa: PLC0415 - after the signals are caught

    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
