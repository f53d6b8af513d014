"""argparse `type=` functions for numeric flags: a bad value is refused while the command
line is parsed, before anything starts, with what was expected. argparse names the flag
and exits 2: `laneserve bench: error: argument --seed: expected an integer >= 0, got '-1'`.

They raise ArgumentTypeError, never ValueError: for a ValueError argparse prints the
function's own name ("invalid _parse value"), not what the flag expects.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An integer in [minimum, maximum] (no upper bound when `maximum` is None)."""
    expected = (
        f"an integer >= {minimum}" if maximum is None else f"an integer in [{minimum}, {maximum}]"
    )

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


__all__ = ["integer"]
