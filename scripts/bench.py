#!/usr/bin/env python3
"""Runs the benchmark harness, the same as `laneserve bench` (see bench/README.md), e.g.
`.venv/bin/python scripts/bench.py --profile quick`."""

import sys

from laneserve.server.bench import main

# The guard matters: the load generator's client processes are spawned, and a spawned
# process imports this file again as __mp_main__.
if __name__ == "__main__":
    sys.exit(main())
