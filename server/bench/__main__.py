"""`python -m laneserve.server.bench`: the same as `laneserve bench`."""

import sys

from laneserve.server.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
