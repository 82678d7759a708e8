"""Decode pool planning: a TP-only pool, a TP+DCP long-context pool, and the threshold.

`plan_pools` sizes both pools for a workload and picks the context threshold that
needs the fewest GPUs; the router sends a turn whose context exceeds
`PoolPlan.threshold_tokens` to the long pool. `plan_table` is the per-device,
per-shape table that `kvtide plan` prints. Both are pure functions of the model,
the device and the workload.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from placement.capacity import (
    DEFAULT_MEMORY,
    EngineMemoryConfig,
    EngineShape,
    memory_plan,
    valid_dcp_degrees,
    valid_tp_degrees,
)
from placement.dcp import ContextMix, DCPCandidate, evaluate_shape
from placement.decode_model import DecodeCalibration, SpeculativeConfig
from placement.devices import DeviceSpec
from placement.model_spec import ModelSpec

__all__ = ["PlanRow", "PoolPlan", "PoolSpec", "Workload", "plan_pools", "plan_table"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """Decode demand: sessions arriving, turns per session, and their contexts."""

    sessions_per_s: float
    contexts: ContextMix  # context of each turn at decode time
    turns_per_session: float = 1.0
    output_tokens_per_turn: int = 512
    min_tokens_per_s_per_user: float = 0.0  # latency target per user; 0 = none

    @property
    def turns_per_s(self) -> float:
        return self.sessions_per_s * self.turns_per_session

    def tokens_per_s(self, share: float = 1.0) -> float:
        """Output tokens per second the decode pools must produce for `share` of turns."""
        return self.turns_per_s * share * self.output_tokens_per_turn


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolSpec:
    """One decode pool: replicas of one engine shape, each at its full batch."""

    contexts: ContextMix
    engine: DCPCandidate
    num_replicas: int
    demand_tokens_per_s: float

    @property
    def shape(self) -> EngineShape:
        return self.engine.shape

    @property
    def num_gpus(self) -> int:
        return self.num_replicas * self.shape.num_gpus


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolPlan:
    """What the router needs (`threshold_tokens`) and what to deploy (the pools)."""

    threshold_tokens: int  # contexts above go to `long_pool`
    short_pool: PoolSpec | None
    long_pool: PoolSpec | None
    reasons: tuple[str, ...]

    @property
    def total_gpus(self) -> int:
        return sum(p.num_gpus for p in (self.short_pool, self.long_pool) if p is not None)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRow:
    """One line of `kvtide plan`: a device and engine shape at the requested load."""

    device: DeviceSpec
    shape: EngineShape
    weight_bytes_per_gpu: int
    kv_budget_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: float
    engine: DCPCandidate

    @property
    def fits(self) -> bool:
        return self.engine.fits


def plan_table(
    spec: ModelSpec,
    devices: Sequence[DeviceSpec],
    *,
    context_tokens: int,
    concurrent_users: int,
    tps: Sequence[int] | None = None,
    memory: EngineMemoryConfig = DEFAULT_MEMORY,
    calibration: DecodeCalibration | None = None,
    speculative: SpeculativeConfig | None = None,
) -> tuple[PlanRow, ...]:
    """Every valid (tp, dcp) per device at one context and load. Without `tps`: the TP
    degrees inside the device's scale-up domain whose weights fit (or the widest one,
    to show that nothing fits)."""
    rows = []
    mix = ContextMix.single(context_tokens)
    for device in devices:
        for tp in tps or _fitting_tps(spec, device, memory):
            for dcp in valid_dcp_degrees(spec, tp):
                shape = EngineShape(tp=tp, dcp=dcp)
                plan = memory_plan(spec, device, shape, memory)
                engine = evaluate_shape(
                    spec,
                    device,
                    shape,
                    mix,
                    concurrent_users,
                    memory=memory,
                    calibration=calibration,
                    speculative=speculative,
                )
                rows.append(
                    PlanRow(
                        device=device,
                        shape=shape,
                        weight_bytes_per_gpu=plan.weight_bytes,
                        kv_budget_bytes_per_gpu=plan.kv_budget_bytes,
                        kv_bytes_per_token_per_gpu=plan.kv_bytes_per_token,
                        engine=engine,
                    )
                )
    return tuple(rows)


def plan_pools(
    spec: ModelSpec,
    device: DeviceSpec,
    workload: Workload,
    *,
    tps: Sequence[int] | None = None,
    memory: EngineMemoryConfig = DEFAULT_MEMORY,
    calibration: DecodeCalibration | None = None,
    speculative: SpeculativeConfig | None = None,
) -> PoolPlan:
    """Size a TP-only pool and a TP+DCP pool and choose the threshold between them.

    A replica decodes the largest batch that memory, `max_num_seqs` and the latency
    target allow; each pool takes the shape that covers its share of output tokens with
    the fewest GPUs. Every bucket boundary is tried as the threshold; the split with the
    fewest GPUs wins, and a single pool wins ties."""
    tp_options = list(tps or _fitting_tps(spec, device, memory))
    engines: dict[tuple[ContextMix, bool], list[DCPCandidate]] = {}

    def pool(mix: ContextMix, allow_dcp: bool, demand: float) -> PoolSpec | None:
        """The shape that serves `demand` with the fewest GPUs (then: most tok/s per GPU,
        then the smaller dcp and tp)."""
        if (mix, allow_dcp) not in engines:
            shapes = [
                EngineShape(tp=tp, dcp=d)
                for tp in tp_options
                for d in (valid_dcp_degrees(spec, tp) if allow_dcp else (1,))
            ]
            found = [
                evaluate_shape(
                    spec,
                    device,
                    s,
                    mix,
                    memory.max_num_seqs,
                    memory=memory,
                    calibration=calibration,
                    speculative=speculative,
                    min_tokens_per_s_per_user=workload.min_tokens_per_s_per_user,
                )
                for s in shapes
            ]
            engines[(mix, allow_dcp)] = [c for c in found if c.fits]
        options = [
            PoolSpec(
                contexts=mix,
                engine=c,
                demand_tokens_per_s=demand,
                num_replicas=max(
                    1, math.ceil(demand / (c.tokens_per_s_per_gpu * c.shape.num_gpus))
                ),
            )
            for c in engines[(mix, allow_dcp)]
        ]
        return min(
            options,
            default=None,
            key=lambda p: (p.num_gpus, -p.engine.tokens_per_s_per_gpu, p.shape.dcp, p.shape.tp),
        )

    total = workload.contexts.total_weight
    plans: list[tuple[int, int, float, int, PoolSpec | None, PoolSpec | None]] = []
    for threshold in [-1, *(t for t, _ in workload.contexts.buckets)]:
        low, high = workload.contexts.split(threshold)
        sides = [
            None
            if mix is None
            else pool(mix, allow_dcp, workload.tokens_per_s(mix.total_weight / total))
            for mix, allow_dcp in ((low, False), (high, True))
        ]
        if (low is not None and sides[0] is None) or (high is not None and sides[1] is None):
            continue  # a side that no shape can serve
        gpus = sum(p.num_gpus for p in sides if p)
        work = sum(p.demand_tokens_per_s / p.engine.tokens_per_s_per_gpu for p in sides if p)
        pools = sum(p is not None for p in sides)
        plans.append((gpus, pools, work, max(threshold, 0), sides[0], sides[1]))
    if not plans:
        return PoolPlan(
            threshold_tokens=workload.contexts.max_tokens,
            short_pool=None,
            long_pool=None,
            reasons=(
                f"no engine of {spec.name} on {device.name} with tp in {tp_options} decodes "
                f"{workload.contexts.max_tokens:,} tokens"
                + (
                    f" at {workload.min_tokens_per_s_per_user} tok/s per user"
                    if workload.min_tokens_per_s_per_user
                    else ""
                )
                + "; use more GPUs per engine or a device with more memory.",
            ),
        )
    # Fewest GPUs; then one pool rather than two; then the least GPU time actually used.
    gpus, _, work, threshold, short, long = min(plans, key=lambda p: (p[0], p[1], p[2]))
    if short is None and long is not None and long.shape.dcp == 1:
        short, long = long, None  # one TP-only pool for everything
    if long is None:
        threshold = workload.contexts.max_tokens
    return PoolPlan(
        threshold_tokens=threshold,
        short_pool=short,
        long_pool=long,
        reasons=_pool_reasons(workload, short, long, threshold, work),
    )


def _pool_reasons(
    workload: Workload, short: PoolSpec | None, long: PoolSpec | None, threshold: int, gpus: float
) -> tuple[str, ...]:
    lines = [
        f"demand: {workload.turns_per_s:,.2f} turns/s x {workload.output_tokens_per_turn} "
        f"output tokens = {workload.tokens_per_s():,.0f} tok/s; about {gpus:,.1f} GPUs "
        "of decode at full batch."
    ]
    for label, pool in (("TP-only pool", short), ("long-context pool", long)):
        if pool is None:
            continue
        e, lowest = pool.engine, pool.contexts.buckets[0][0]
        lines.append(
            f"{label}: contexts {lowest:,}-{pool.contexts.max_tokens:,} tokens "
            f"(mean {pool.contexts.mean_tokens:,.0f}), tp={e.shape.tp} dcp={e.shape.dcp}, batch "
            f"{e.batch_size}, {e.tokens_per_s_per_gpu:,.1f} tok/s per GPU, {pool.num_replicas} "
            f"replica(s) = {pool.num_gpus} GPUs for {pool.demand_tokens_per_s:,.0f} tok/s."
        )
    if short and long:
        lines.append(
            f"route contexts above {threshold:,} tokens to the long-context pool: "
            "this split needs the fewest GPUs."
        )
    else:
        lines.append("one pool serves every context: no split needs fewer GPUs.")
    return tuple(lines)


def _fitting_tps(spec: ModelSpec, device: DeviceSpec, memory: EngineMemoryConfig) -> list[int]:
    inside = [tp for tp in valid_tp_degrees(spec) if tp <= device.nvlink_domain_size]
    fitting = [tp for tp in inside if memory_plan(spec, device, EngineShape(tp=tp), memory).fits]
    return fitting or inside[-1:]
