"""Retries: capped attempts, exponential backoff with jitter, the server's pushback, and
never past the caller's deadline.

The delay before retry ``n`` (1 for the first retry) is::

    base = min(max_backoff_s, initial_backoff_s * multiplier ** (n - 1))
    hint = min(server_hint_s, max_backoff_s)
    hinted = uniform(hint, min(hint * (1 + jitter), max_backoff_s))
    delay = max(hinted, base * uniform(1 - jitter, 1))

so a server that says "retry in 40 ms" (``RetryInfo`` / ``grpc-retry-pushback-ms``) is
never asked again sooner, and clients that failed together do not retry together, the
server's hint included: it is jittered upward, as a server answers every caller refused
at once with the same hint (MEMORY_PRESSURE's constant 0.25 s sent 1000 of them back at
exactly 250 ms). A hint beyond ``max_backoff_s`` is honoured up to it: no server's hint
stalls a caller longer than its own policy allows (a retry that comes too soon is
refused again, and attempts stay capped). A retry that would start after the caller's
deadline is not made: the last error is raised at once, with a note saying why the
retries stopped.

A client's calls also share one `RetryBudget` (gRPC's retryThrottling) against
amplifying overload: each refusal that says the server is overloaded (`is_overload`)
takes a token, each success puts back ``token_ratio``, and such a refusal is retried only
while more than half of ``max_tokens`` is left. An overloaded server is then sent at most
about ``token_ratio`` retries per success, not up to ``max_attempts - 1`` per request. A
draining, unreachable or cut-off server's refusals neither take tokens nor wait for them:
their retries go to another instance or a restarted one, and ``max_attempts`` bounds them
per call.

For tests, ``set_testing(True)`` turns every backoff sleep into no sleep (like stamina's
switch of the same name), and optionally caps attempts too::

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
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from laneserve.client._channel import checked_integer
from laneserve.client._errors import (
    ClientClosedError,
    DeadlineExceededError,
    LaneserveError,
    ResourceExhaustedError,
)

__all__ = ["NO_RETRIES", "RetryBudget", "RetryPolicy", "is_testing", "set_testing"]

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
        hint, honoured up to `max_backoff_s`.

        The hint is jittered upward, within [hint, min(hint * (1 + jitter), cap)]: never
        sooner than the server asked, and spread apart (the callers it refused at once all
        got the same hint; taken as is, they all came back at the same instant). A hint at
        or above the cap gives the cap itself: going sooner would go further against what
        the server asked, and the call's deadline is judged by it (a hint of 10 s with 5 s
        left is not retried).
        """
        backoff = self.backoff_s(retry, rng)
        if server_hint_s is None:
            return backoff
        cap = self.max_backoff_s
        hint = min(server_hint_s, cap)
        top = min(hint * (1 + self.jitter), cap)  # the cap itself for a hint at it
        draw = (rng or _RNG).random()
        return max(hint + (top - hint) * draw, backoff)


# The least `token_ratio`: tokens are counted in thousandths.
_MILLI = 0.001


@dataclasses.dataclass(frozen=True, slots=True)
class RetryBudget:
    """How many retries of overload refusals one client makes across its unary calls:
    gRPC's retryThrottling (proposal A6), a bucket of tokens, full at first.

    Each attempt refused as overloaded (`is_overload`: LANE_FULL, MEMORY_PRESSURE,
    JOIN_LIMIT, a server busy at its call limits) takes a token, each success puts back
    `token_ratio`, and such a refusal is retried only while more than ``max_tokens / 2``
    tokens are left after its own. A `RetryPolicy` caps the attempts of one call; the
    budget caps what all of them send an overloaded server: since each retry takes a
    token from above the half-way mark, which only successes refill, the retries made
    from a full bucket number at most ``max_tokens / 2 + token_ratio * successes`` (about
    `token_ratio` per success in steady state: 0.1 by default, where the policy alone
    allowed 5 per request).

    DRAINING, UNAVAILABLE and a network's CANCELLED take no token and are retried
    whatever is left: they say nothing of load, and their retry goes to another instance
    or a restarted one (charged, a rolling restart failed every call past the 50th in
    flight, where one retry reached a healthy instance).

    The default 100 tokens keep every retry of a lone call on a fresh client (its 6
    attempts take 5 tokens before their last retry: ``max_tokens >= 2 * (max_attempts -
    1) + 1`` is needed), and of eight such calls refused together (48 tokens); with no
    success between them, the 50th overload refusal is the first the budget stops, and
    a storm then runs at its steady state.

    Not counted (a departure from A6, which charges every retryable status): a bare
    CANCELLED from gRPC's core refusing a call at its backlog (max_pending_calls) cannot be
    told from a network cut, nor a proxy's UNAVAILABLE from a lost connection. Nor are
    `stream()`'s item resends: a resent item keeps its place in the job's window through
    its backoff, so retries slow a job's sending rather than add to it.
    """

    # Tokens in the bucket, which starts full; retries stop at half of them.
    max_tokens: int = 100
    # Tokens a successful attempt puts back (an overload refusal takes 1). Counted in
    # thousandths of a token, as gRPC does: ten successes of 0.1 make exactly one.
    token_ratio: float = 0.1

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_tokens", checked_integer("max_tokens", self.max_tokens))
        object.__setattr__(self, "token_ratio", _checked_real("token_ratio", self.token_ratio))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected >= 1, got {self.max_tokens}")
        if not math.isfinite(self.token_ratio) or self.token_ratio < _MILLI:
            raise ValueError(
                f"token_ratio: expected a finite number >= {_MILLI} (thousandths of a "
                f"token), got {self.token_ratio!r}"
            )


class RetryTokens:
    """The bucket of a client's `RetryBudget`, shared by all its calls."""

    def __init__(self, budget: RetryBudget) -> None:
        self.budget = budget
        self._full_milli = budget.max_tokens * 1000
        self._ratio_milli = round(budget.token_ratio * 1000)
        # Guarded by `_lock`; 0 <= `_milli` <= `_full_milli`. A client's calls run on
        # the loop it serves, but a sync Client's run on its thread and a client moves
        # to another thread's loop once its own is closed: the take and its verdict stay
        # one step whichever thread records.
        self._lock = threading.Lock()
        self._milli = self._full_milli

    @property
    def tokens(self) -> float:
        return self._milli / 1000

    def record_success(self) -> None:
        with self._lock:
            self._milli = min(self._full_milli, self._milli + self._ratio_milli)

    def record_failure(self) -> bool:
        """Takes a token for an overload refusal; True while a retry may follow it
        (more than half the bucket left)."""
        with self._lock:
            self._milli = max(0, self._milli - 1000)
            return self._milli * 2 > self._full_milli


def is_overload(error: LaneserveError) -> bool:
    """Whether `error` says the server is overloaded, the refusals a `RetryBudget`
    counts and stops: the retryable ResourceExhaustedErrors, exactly LaneFullError,
    MemoryPressureError, JoinLimitError and ServerBusyError (max_concurrent_rpcs, the
    stream and operator bounds). The others of that class (the message size limit,
    DEVICE_MEMORY, ANSWER_TOO_LARGE) are not retried; DRAINING, UNAVAILABLE and
    CANCELLED are retryable, but say the server is going or the network cut the call."""
    return error.retryable and isinstance(error, ResourceExhaustedError)


def checked_budget(budget: object, field: str) -> RetryBudget | None:
    """`budget` (a client's `field`), a RetryBudget or None; TypeError naming `field`
    for anything else."""
    return _checked_optional(budget, RetryBudget, field)


NO_RETRIES = RetryPolicy(max_attempts=1)


def checked_policy(retry: object, field: str) -> RetryPolicy | None:
    """`retry` (a client's or a call's `field`), a RetryPolicy or None.

    Raises:
        TypeError: anything else, naming `field` (``retry=3`` failed at the call with
            "'int' object has no attribute 'max_attempts'").
    """
    return _checked_optional(
        retry, RetryPolicy, field, "; RetryPolicy(max_attempts=N) for N attempts"
    )


def _checked_optional(value: object, kind: type[T], field: str, hint: str = "") -> T | None:
    """`value` if it is a `kind` or None; TypeError naming `field` and what came."""
    if value is not None and not isinstance(value, kind):
        raise TypeError(
            f"{field}: expected a {kind.__name__} or None, got {type(value).__name__} "
            f"({reprlib.repr(value)}){hint}"
        )
    return value


_RNG = random.Random()  # noqa: S311 - jitter spreads retries; it guards no secret


@dataclasses.dataclass(frozen=True, slots=True)
class _Testing:
    max_attempts: int | None


_testing: _Testing | None = None


def set_testing(enabled: bool, *, max_attempts: int | None = None) -> None:
    """Test mode: no backoff sleeps at all, and optionally at most `max_attempts` attempts.

    Deadlines, caps and the retry decisions stay as they are, the client's
    `RetryBudget` included; only the waiting goes.
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
    budget: RetryTokens | None = None,
    spent_s: float = 0.0,
    request_id: str = "",
) -> T:
    """Runs `attempt(left_s)` until it succeeds, fails for good, runs out of attempts or
    of the client's `budget` (None: no budget), or the next attempt would start after the
    call's deadline, `timeout_s` seconds from its start (None: none), `spent_s` seconds
    ago (building its request). A deadline passed before the first attempt (a timeout of
    0, a request slow to build) is DeadlineExceededError, attempts 0, nothing sent
    (`request_id`: the call's).

    `left_s` is what is left of the deadline (None: no deadline): each attempt passes it
    on as its gRPC deadline, so no attempt runs past the caller's. Once `closed` is set
    (the client was closed) no retry is made and a backoff in progress ends at once:
    ClientClosedError, with the last error as its cause.

    The error raised carries in `attempts` the attempts sent: an attempt's error whose
    `attempts` is 0 is one the client refused before sending it, and is not counted.
    """
    deadline_s = None if timeout_s is None else time.monotonic() + timeout_s - spent_s
    allowed = attempts_allowed(policy)
    number = 0
    last: LaneserveError | None = None
    while True:
        number += 1
        left_s = None if deadline_s is None else deadline_s - time.monotonic()
        # Before the first attempt, on this one reading (read apart, the deadline passed
        # between the check and the attempt, sent with no time left). A closed client's
        # attempt says so itself (ClientClosedError, as the README promises).
        if last is None and left_s is not None and left_s <= 0 and not _set(closed):
            raise _passed_before_sending(what, timeout_s, spent_s, request_id)
        if last is not None and left_s is not None and left_s <= 0:
            # The backoff overran the deadline (a busy machine): the next attempt would
            # start after it, so the last real error is the answer, as decided above.
            last.add_note(
                f"{what}: gave up after {number - 1} attempt(s): the next would start "
                "after the deadline (the wait overran it)"
            )
            raise last
        try:
            result = await attempt(left_s)
        except LaneserveError as error:
            last = error
            # An attempt the client refused before sending it (attempts 0: it was closed)
            # is not counted: `attempts` counts the attempts sent.
            error.attempts = number if error.attempts else number - 1
            # Every overload refusal takes its token, the last attempt's and a negative
            # pushback's too (as in gRPC): the bucket gauges the server's load, not this
            # call. No other failure takes one or is stopped by the bucket: a draining or
            # unreachable server's retry goes elsewhere, and max_attempts bounds it.
            budget_left = budget is None or not is_overload(error) or budget.record_failure()
            if timeout_s is not None and _is_own_deadline(error):
                raise _timed_out(error, what, timeout_s) from error
            if not error.should_retry:
                raise
            if number >= allowed:
                error.add_note(f"{what}: gave up after {number} attempt(s) (max_attempts)")
                raise
            if not budget_left:
                assert budget is not None
                error.add_note(_budget_spent(what, number, budget))
                raise
            # The decision uses the real delay; test mode only skips the waiting.
            delay_s = policy.delay_s(number, error.retry_after_s)
            if deadline_s is not None and time.monotonic() + delay_s >= deadline_s:
                error.add_note(
                    f"{what}: gave up after {number} attempt(s): the next would start "
                    f"after the deadline ({retry_wait(delay_s, error.retry_after_s)})"
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
                closed_error = ClientClosedError(
                    f"{what}: the client was closed while the call waited to retry "
                    f"(after {number} attempt(s))",
                    request_id=error.request_id,
                )
                closed_error.attempts = number
                raise closed_error from error
        else:
            if budget is not None:
                budget.record_success()
            return result


def retry_wait(delay_s: float, server_hint_s: float | None) -> str:
    """What a note says of a retry's wait (`RetryPolicy.delay_s`): its length and whose it
    is. "in 53 ms" alone read as the server's doing where the server had hinted 2 ms and
    the wait was this client's own backoff (a user's evaluation)."""
    waited = f"in {delay_s * 1000:.0f} ms"
    if server_hint_s is None:
        return f"{waited}: this client's backoff, RetryPolicy's initial_backoff_s doubled"
    return (
        f"{waited}: the longer of this client's backoff (RetryPolicy's initial_backoff_s "
        f"doubled) and the server's hint of {server_hint_s * 1000:.0f} ms"
    )


def _budget_spent(what: str, number: int, budget: RetryTokens) -> str:
    """The note of a call whose retry the client's budget stopped."""
    limit = budget.budget
    return (
        f"{what}: gave up after {number} attempt(s): retry budget spent: too many of this "
        f"client's attempts were refused as overloaded of late ({budget.tokens:g} of "
        f"{limit.max_tokens} tokens left; retries resume above {limit.max_tokens / 2:g}, "
        f"each success puts back {limit.token_ratio:g}: RetryBudget)"
    )


def _set(event: asyncio.Event | None) -> bool:
    return event is not None and event.is_set()


def _passed_before_sending(
    what: str, timeout_s: float | None, spent_s: float, request_id: str
) -> DeadlineExceededError:
    """The call's DeadlineExceededError when its deadline passed before its first attempt:
    nothing sent, attempts 0."""
    if timeout_s == 0:
        why = "its timeout, 0 or less, had passed already (what was left of a deadline)"
    else:
        why = (
            f"its timeout of {timeout_s:g} s passed before its first attempt, "
            f"{spent_s * 1000:.1f} ms after the call began (building its request included)"
        )
    passed = DeadlineExceededError(
        f"{what}: {why}; nothing was sent; expected a timeout above 0 that covers building "
        "the request",
        code=grpc.StatusCode.DEADLINE_EXCEEDED,
        request_id=request_id,
    )
    passed.attempts = 0
    return passed


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
