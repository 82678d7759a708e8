"""Value types of the KV lifecycle simulator: what a run is given, and what it measured.

`SimConfig` carries the policy under test (with its cost inputs) and the cluster it
runs on; `SimResult` is a run's counts, memory and time saved. Both are frozen; import
them from `policies.kv_sim`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from policies.kv_lifecycle import KVLifecycleConfig, RecomputeReason

__all__ = ["SimConfig", "SimResult"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """The policy under test and the cluster it runs on.

    The policy config carries the cost inputs (``prefill_tokens_per_s``,
    ``link_bandwidth_gbps``, ``kv_bytes_per_token`` per engine, ...): the simulator
    prices turns with the same figures the policy decides with.
    """

    policy: KVLifecycleConfig = field(default_factory=KVLifecycleConfig)
    num_decode_engines: int = 4
    decode_tokens_per_s: float = 40.0
    """Decode speed per user: how long a turn's output takes."""
    tick_s: float = 1.0
    """How often ``on_tick`` runs (the orchestrator ticks about once a second)."""
    drain: bool = True
    """Apply drainable effects as the router does: read the blocks into a prefill
    engine, which frees them on the decode engine. False: they stay pinned until
    their expiry, as when nothing drains."""
    token_unit: int = 1
    """Tokens per synthetic token id. 1 replays token by token. A larger unit (a
    divisor of the block size and the threshold) makes the id lists, and so the
    policy's prefix hashes that dominate the run time, that many times shorter: each
    prompt addition and output is rounded up to whole units, and the policy is run on
    `policy_in_units`, which prices and books them as the same tokens and bytes."""
    measure_window_s: tuple[float, float] | None = None
    """Time span the mean memory is taken over; None: the whole run. Leave out the
    warm-up (memory grows for about a TTL) and the drain after the last arrival."""

    def __post_init__(self) -> None:
        if self.num_decode_engines < 1:
            raise ValueError(f"SimConfig.num_decode_engines={self.num_decode_engines}: use >= 1")
        if not (self.decode_tokens_per_s > 0 and self.tick_s > 0):
            raise ValueError("SimConfig: decode_tokens_per_s and tick_s must be > 0")
        unit, policy = self.token_unit, self.policy
        if unit < 1 or policy.block_size_tokens % unit or policy.recompute_threshold_tokens % unit:
            raise ValueError(
                f"SimConfig.token_unit={unit}: use a positive divisor of block_size_tokens "
                f"({policy.block_size_tokens}) and recompute_threshold_tokens "
                f"({policy.recompute_threshold_tokens}), or 1"
            )
        window = self.measure_window_s
        if window is not None and not 0 <= window[0] < window[1]:
            raise ValueError(f"SimConfig.measure_window_s={window}: use (start, end), start < end")

    @property
    def policy_in_units(self) -> KVLifecycleConfig:
        """The policy config with token counts and rates in ``token_unit``s."""
        unit, policy = self.token_unit, self.policy
        if unit == 1:
            return policy
        return replace(
            policy,
            kv_bytes_per_token=policy.kv_bytes_per_token * unit,
            block_size_tokens=policy.block_size_tokens // unit,
            recompute_threshold_tokens=policy.recompute_threshold_tokens // unit,
            prefill_tokens_per_s=policy.prefill_tokens_per_s / unit,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SimResult:
    """What one replay measured. Bytes are per decode engine, summed over its GPUs;
    seconds are estimates of the policy's cost model."""

    num_sessions: int
    num_turns: int
    num_pulls: int
    recomputes_by_reason: tuple[tuple[RecomputeReason, int], ...]
    """Every reason with its count, in `RecomputeReason` order."""
    num_expiries: int
    num_evictions: int
    num_releases: int
    """`KVStats` counters of the policy at the end of the run."""
    mean_held_bytes_per_engine: float
    """Time-weighted mean over the measure window and the engines."""
    peak_held_bytes_per_engine: int
    """Largest ``bytes_held`` of any engine at any moment."""
    peak_idle_bytes_per_engine: int
    """Largest ``idle_bytes`` of any engine after any call: never above the budget."""
    mean_pinned_bytes_per_engine: float
    """As held, for the blocks the engines keep until read (pulled or drained) or expired."""
    peak_pinned_bytes_per_engine: int
    recompute_s_avoided: float
    """Prefill seconds the pulled prefixes would have cost to recompute."""
    transfer_s: float
    """Seconds the pulls took (estimated transfer time, setup included)."""
    num_drains: int
    """Records the router would drain (read back to free the blocks early)."""
    num_undrainable: int
    """Drainable records whose tokens the session no longer starts with."""
    drain_s: float
    """Link seconds the drains take (estimated transfer time, setup included)."""
    end_s: float
    """When the last turn finished."""

    @property
    def hit_rate(self) -> float:
        """Share of turns that pulled their prefix back (first turns included)."""
        return self.num_pulls / self.num_turns if self.num_turns else 0.0

    @property
    def ttft_saved_s(self) -> float:
        return self.recompute_s_avoided - self.transfer_s

    @property
    def ttft_saved_per_turn_s(self) -> float:
        return self.ttft_saved_s / self.num_turns if self.num_turns else 0.0

    def num_recomputes_for(self, reason: RecomputeReason) -> int:
        return dict(self.recomputes_by_reason)[reason]
