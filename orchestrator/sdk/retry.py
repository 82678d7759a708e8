"""When to retry and how long to wait: a pure policy, with time and randomness passed in.

A turn is safe to retry because every attempt carries the same ``idempotency-key``: the
server runs the turn at most once and replays the stored result of a completed one
(``409 turn_in_progress`` while it still runs). So the SDK retries connection failures
and the transient answers named in ``orchestrator.sdk.errors.is_retryable``, waiting an
exponentially growing, jittered delay, or the server's ``retry-after`` when it sends one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from orchestrator.sdk.errors import KVTideAPIError

__all__ = ["RetryPolicy", "parse_retry_after"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """Bounded retries with exponential backoff and jitter.

    ``max_retries`` counts retries, so a call makes at most ``max_retries + 1`` attempts.
    Attempt ``n`` (0-based) that fails waits ``min(max_backoff_s, initial_backoff_s * 2**n)``
    shortened by up to ``jitter`` of itself (so clients that failed together spread out),
    unless the server said ``retry-after`` with a value up to ``max_retry_after_s``.
    """

    max_retries: int = 3
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    jitter: float = 0.25
    max_retry_after_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("backoff times must be >= 0")

    def delay_s(
        self, attempt: int, error: KVTideAPIError, retry_after_s: float | None, rand: float
    ) -> float | None:
        """Seconds to wait before the next attempt, or ``None`` to raise ``error`` now.

        ``attempt`` is the 0-based index of the attempt that just failed; ``rand`` is a
        uniform draw in [0, 1) from the caller's random source.
        """
        if not error.retryable or attempt >= self.max_retries:
            return None
        if retry_after_s is not None and 0.0 <= retry_after_s <= self.max_retry_after_s:
            return retry_after_s
        backoff = min(self.max_backoff_s, self.initial_backoff_s * 2.0**attempt)
        return backoff * (1.0 - self.jitter * rand)


def parse_retry_after(headers: Mapping[str, str]) -> float | None:
    """The server's ``retry-after`` (or ``retry-after-ms``) in seconds; ``None`` when absent
    or an HTTP date (dates need a wall clock the SDK does not trust across machines)."""
    raw_ms = headers.get("retry-after-ms")
    if raw_ms is not None:
        try:
            return float(raw_ms) / 1000.0
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        return float(raw)
    except ValueError:
        return None
