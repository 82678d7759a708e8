"""What an engine host reports to Serve's autoscaler (its ``record_autoscaling_stats``).

Serve calls the replica's ``record_autoscaling_stats`` every
``RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S`` and hands the numbers, per
replica and averaged over the deployment's look-back window, to the pool's policy in the
controller (``AutoscalingContext.aggregated_metrics``). ``LoadMeter`` turns the engine's
counters into what the policy sizes by: rates between two readings (prompt tokens
computed per second, and the engine's prefill rate while it was busy throughout; tokens
generated per second, and from them the mean inter-token latency), the prompt tokens
this host has taken and not finished (the prefill backlog), the KV blocks in use and
those kept for paused sessions (what the KV service books on the engine,
``EngineLedger.num_kept_blocks``), and how long the engine took to start.
Single-threaded (the host's event loop); the clock is the host's, passed in.
"""

from __future__ import annotations

from collections.abc import Callable

from engines.base import EngineStats

__all__ = ["STAT_KEYS", "LoadMeter"]

STAT_KEYS = (
    "queued_prompt_tokens",
    "prompt_tokens_per_s",
    "prefill_tokens_per_s",
    "num_running",
    "num_waiting",
    "kv_blocks",
    "kv_blocks_used",
    "kv_blocks_held",
    "itl_s",
    "engine_start_s",
)
"""The keys of each report (every one a number; ``prefill_tokens_per_s`` and ``itl_s``
are 0 until measured)."""

# A busy interval's rate moves the measured prefill rate by this share.
RATE_WEIGHT = 0.5


class LoadMeter:
    """One engine host's load, between two readings of its engine's counters."""

    def __init__(self, *, clock: Callable[[], float], engine_start_s: float) -> None:
        self._clock = clock
        self.engine_start_s = engine_start_s
        self.queued_prompt_tokens = 0
        self._last: tuple[float, EngineStats, int] | None = None
        self.prefill_tokens_per_s = 0.0

    def prompt_taken(self, num_tokens: int) -> None:
        """A request's prompt reached this host (to compute, or to pull)."""
        self.queued_prompt_tokens += num_tokens

    def prompt_done(self, num_tokens: int) -> None:
        """That request ended (its prompt computed, or it failed)."""
        self.queued_prompt_tokens = max(0, self.queued_prompt_tokens - num_tokens)

    def report(
        self, stats: EngineStats, *, num_kv_blocks: int, kv_blocks_kept: int
    ) -> dict[str, float]:
        """This reading, with the rates since the last one."""
        now = self._clock()
        prompt_rate = gen_rate = 0.0
        if self._last is not None:
            then, before, queued_before = self._last
            dt = now - then
            if dt > 0:
                prompt_rate = (stats.num_prompt_tokens - before.num_prompt_tokens) / dt
                gen_rate = (stats.num_generation_tokens - before.num_generation_tokens) / dt
                if queued_before > 0 and self.queued_prompt_tokens > 0 and prompt_rate > 0:
                    # Busy from one reading to the next: the rate is what it computes.
                    self.prefill_tokens_per_s = (
                        prompt_rate
                        if self.prefill_tokens_per_s == 0
                        else (1 - RATE_WEIGHT) * self.prefill_tokens_per_s
                        + RATE_WEIGHT * prompt_rate
                    )
        self._last = (now, stats, self.queued_prompt_tokens)
        used = round(stats.kv_cache_usage * num_kv_blocks)
        running = stats.num_running
        return {
            "queued_prompt_tokens": float(self.queued_prompt_tokens),
            "prompt_tokens_per_s": prompt_rate,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "num_running": float(running),
            "num_waiting": float(stats.num_waiting + stats.num_blocked),
            "kv_blocks": float(num_kv_blocks),
            "kv_blocks_used": float(used),
            # Kept for sessions between turns, as far as the engine still uses blocks.
            "kv_blocks_held": float(min(kv_blocks_kept, used)),
            # Each running sequence gets one token per step: a step every running/rate s.
            "itl_s": running / gen_rate if running and gen_rate > 0 else 0.0,
            "engine_start_s": self.engine_start_s,
        }
