"""Retries: capped attempts, exponential backoff with jitter, the server's pushback, and
never past the caller's deadline.

The delay before retry ``n`` (1 for the first retry) is::

    base = min(max_backoff_s, initial_backoff_s * multiplier ** (n - 1))
    delay = max(min(server_hint_s, max_backoff_s), base * uniform(1 - jitter, 1))

so a server that says "retry in 40 ms" (``RetryInfo`` / ``grpc-retry-pushback-ms``) is
never asked again sooner, and clients that failed together do not retry together. A
hint beyond ``max_backoff_s`` is honoured up to it: no server's hint stalls a caller
longer than its own policy allows (a retry that comes too soon is refused again, and
attempts stay capped). A
retry that would start after the caller's deadline is not made: the last error is raised
at once, with a note saying why the retries stopped.

For tests, ``set_testing(True)`` turns every backoff sleep into no sleep (like stamina's
switch of the same name), optionally capping attempts too::

    from laneserve import client

    client.set_testing(True, max_attempts=2)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import numbers
import random
import reprlib
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from laneserve.client._channel import checked_integer
from laneserve.client._errors import ClientClosedError, DeadlineExceededError, LaneserveError

__all__ = ["NO_RETRIES", "RetryPolicy", "is_testing", "set_testing"]

log = logging.getLogger("laneserve.client")

T = TypeVar("T")


def _checked_real(field: str, value: object) -> float:
    """`value`, a policy's number `field`, as a float; TypeError naming `field` where it
    is no real number (or is a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{field}: expected a number, got {reprlib.repr(value)}")
    return float(value)


@dataclasses.dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how patiently to retry retryable failures.

    The defaults retry for about 3 seconds at most (0.1 + 0.2 + 0.4 + 0.8 + 1.6 s before
    jitter), bounded by the call's own timeout whenever that is shorter.
    """

    # Attempts in all, the first included; 1 means no retries.
    max_attempts: int = 6
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    multiplier: float = 2.0
    # Fraction of each delay that is random: the delay is drawn from
    # [base * (1 - jitter), base].
    jitter: float = 0.5

    def __post_init__(self) -> None:
        # Types first, by the client's one rule (a numpy number is taken, a bool is not),
        # stored as int and float: a str failed in math.isfinite naming no field.
        object.__setattr__(self, "max_attempts", checked_integer("max_attempts", self.max_attempts))
        for key in ("initial_backoff_s", "max_backoff_s", "multiplier", "jitter"):
            object.__setattr__(self, key, _checked_real(key, getattr(self, key)))
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts: expected >= 1, got {self.max_attempts}")
        for key in ("initial_backoff_s", "max_backoff_s"):
            value = getattr(self, key)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{key}: expected finite seconds >= 0, got {value!r}")
        if not math.isfinite(self.multiplier) or self.multiplier < 1:
            raise ValueError(f"multiplier: expected a number >= 1, got {self.multiplier!r}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter: expected a fraction in [0, 1], got {self.jitter!r}")

    def backoff_s(self, retry: int, rng: random.Random | None = None) -> float:
        """The jittered exponential delay before retry number `retry` (1-based)."""
        assert retry >= 1
        try:
            growth = self.multiplier ** (retry - 1)
        except OverflowError:  # a float power past ~1e308 raises (1e6 ** 60), never inf
            growth = math.inf
        grown = self.initial_backoff_s * growth if self.initial_backoff_s else 0.0  # not 0 * inf
        base = min(self.max_backoff_s, grown)
        draw = (rng or _RNG).random()
        return base * (1 - self.jitter * draw)

    def delay_s(
        self, retry: int, server_hint_s: float | None, rng: random.Random | None = None
    ) -> float:
        """The delay before retry `retry`: the backoff, but never less than the server's
        hint, honoured up to `max_backoff_s`."""
        backoff = self.backoff_s(retry, rng)
        if server_hint_s is None:
            return backoff
        return max(min(server_hint_s, self.max_backoff_s), backoff)


NO_RETRIES = RetryPolicy(max_attempts=1)


def checked_policy(retry: object, field: str) -> RetryPolicy | None:
    """`retry` (a client's or a call's `field`), a RetryPolicy or None.

    Raises:
        TypeError: anything else, naming `field` (``retry=3`` failed at the call with
            "'int' object has no attribute 'max_attempts'").
    """
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise TypeError(
            f"{field}: expected a RetryPolicy or None, got {type(retry).__name__} "
            f"({reprlib.repr(retry)}); RetryPolicy(max_attempts=N) for N attempts"
        )
    return retry


_RNG = random.Random()  # noqa: S311 - jitter spreads retries; it guards no secret


@dataclasses.dataclass(frozen=True, slots=True)
class _Testing:
    max_attempts: int | None


_testing: _Testing | None = None


def set_testing(enabled: bool, *, max_attempts: int | None = None) -> None:
    """Test mode: no backoff sleeps at all, and optionally at most `max_attempts` attempts.

    Deadlines, caps and the retry decisions stay as they are; only the waiting goes.
    """
    global _testing  # noqa: PLW0603 - the switch is process-wide on purpose, like stamina's
    if max_attempts is not None and max_attempts < 1:
        raise ValueError(f"max_attempts: expected >= 1 or None, got {max_attempts}")
    _testing = _Testing(max_attempts) if enabled else None


def is_testing() -> bool:
    return _testing is not None


def attempts_allowed(policy: RetryPolicy) -> int:
    if _testing is not None and _testing.max_attempts is not None:
        return min(policy.max_attempts, _testing.max_attempts)
    return policy.max_attempts


def effective_delay_s(delay_s: float) -> float:
    """The delay actually slept: none in test mode."""
    return 0.0 if _testing is not None else delay_s


async def call_with_retries(
    attempt: Callable[[float | None], Awaitable[T]],
    *,
    policy: RetryPolicy,
    timeout_s: float | None,
    what: str,
    closed: asyncio.Event | None = None,
) -> T:
    """Runs `attempt(left_s)` until it succeeds, fails for good, runs out of attempts, or
    the next attempt would start after the call's deadline, `timeout_s` seconds from now
    (None: none).

    `left_s` is what is left of the deadline (None: no deadline): each attempt passes it
    on as its gRPC deadline, so no attempt runs past the caller's. Once `closed` is set
    (the client was closed) no retry is made and a backoff in progress ends at once:
    ClientClosedError, with the last error as its cause.
    """
    deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
    allowed = attempts_allowed(policy)
    number = 0
    last: LaneserveError | None = None
    while True:
        number += 1
        left_s = None if deadline_s is None else deadline_s - time.monotonic()
        if last is not None and left_s is not None and left_s <= 0:
            # The backoff overran the deadline (a busy machine): the next attempt would
            # start after it, so the last real error is the answer, as decided above.
            last.add_note(
                f"{what}: gave up after {number - 1} attempt(s): the next would start "
                "after the deadline (the wait overran it)"
            )
            raise last
        try:
            return await attempt(left_s)
        except LaneserveError as error:
            last = error
            error.attempts = number
            if timeout_s is not None and _is_own_deadline(error):
                raise _timed_out(error, what, timeout_s) from error
            if not error.should_retry:
                raise
            if number >= allowed:
                error.add_note(f"{what}: gave up after {number} attempt(s) (max_attempts)")
                raise
            # The decision uses the real delay; test mode only skips the waiting.
            delay_s = policy.delay_s(number, error.retry_after_s)
            if deadline_s is not None and time.monotonic() + delay_s >= deadline_s:
                error.add_note(
                    f"{what}: gave up after {number} attempt(s): the next would start "
                    f"after the deadline (in {delay_s * 1000:.0f} ms)"
                )
                raise
            delay_s = effective_delay_s(delay_s)
            log.debug(
                "%s: %s; retry %d in %.0f ms",
                what,
                error.reason or error.code.name,
                number,
                delay_s * 1000,
            )
            if await closed_within(closed, delay_s):
                raise ClientClosedError(
                    f"{what}: the client was closed while the call waited to retry "
                    f"(after {number} attempt(s))",
                    request_id=error.request_id,
                ) from error


def _is_own_deadline(error: LaneserveError) -> bool:
    """Whether `error` is gRPC's for a call whose deadline passed (the server's own
    deadline answers name a reason: EXPIRED_IN_QUEUE, DEADLINE_UNMEETABLE)."""
    return type(error) is DeadlineExceededError and not error.reason


def _timed_out(error: LaneserveError, what: str, timeout_s: float) -> DeadlineExceededError:
    """`error` (gRPC's bare "Deadline Exceeded") with the call's timeout and attempts."""
    timed_out = DeadlineExceededError(
        f"{what}: the call's timeout of {timeout_s:g} s passed after {error.attempts} "
        "attempt(s); expected an answer within it (a longer timeout, or a less busy server)",
        code=error.code,
        request_id=error.request_id,
    )
    timed_out.attempts = error.attempts
    return timed_out


async def closed_within(closed: asyncio.Event | None, delay_s: float) -> bool:
    """Waits `delay_s`; True as soon as `closed` is set (at once if it already is)."""
    if closed is None:
        await asyncio.sleep(delay_s)
        return False
    if closed.is_set():
        return True
    try:
        await asyncio.wait_for(closed.wait(), delay_s)
    except TimeoutError:
        return False
    return True
