"""argparse `type=` functions for numeric flags: a bad value is refused while the command
line is parsed, before anything starts, with what was expected. argparse names the flag
and exits 2: `laneserve bench: error: argument --seed: expected an integer >= 0, got '-1'`.

They raise ArgumentTypeError, never ValueError: for a ValueError argparse prints the
function's own name ("invalid _parse value"), not what the flag expects.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from laneserve.client._channel import check_target


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


def seconds(*, zero_ok: bool, maximum_s: float) -> Callable[[str], float]:
    """Finite seconds, > 0 (or >= 0 with `zero_ok`) and at most `maximum_s`: nan and inf
    are refused, as a sleep or a deadline cannot take them."""
    expected = f"seconds {'>=' if zero_ok else '>'} 0 and at most {maximum_s:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        low_ok = value >= 0 if zero_ok else value > 0
        if not (low_ok and value <= maximum_s):  # false for nan
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


def target(text: str) -> str:
    """A gRPC target, refused where gRPC would take it for another port or fail every call
    (`check_target`: a port outside 1..65535 wraps around; an empty target)."""
    try:
        return check_target(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


__all__ = ["integer", "seconds", "target"]
