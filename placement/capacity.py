"""The memory model: what one engine holds per GPU, and how many sequences fit.

Per GPU of an engine with tensor parallelism `tp`, decode context parallelism `dcp`
(which reuses the TP ranks, it adds no GPUs) and `pp` pipeline stages:

    budget     = memory_bytes x gpu_memory_utilization
    kv_budget  = budget - weights_per_gpu - activation_reserve
    sequences  = kv_budget // (context x kv_bytes_per_token_per_gpu + linear_state_per_gpu)

Weights: attention heads, MLP widths, vocabulary and linear-attention heads are split
over TP; routed experts are split over TP as well (expert parallelism = TP, or each
expert TP-sharded: the bytes per GPU are the same); norms, routers and MLA's
down-projections are replicated; K/V projections are split by KV head and replicated
once TP exceeds the KV heads. Pipeline stages split the layers; each stage is charged
the embedding and head (an upper bound).

KV cache per token per GPU, one entry per full-attention layer:

    MLA: (kv_lora_rank + qk_rope_head_dim) x bytes   -- one latent "head", so every TP
         rank holds a full copy; DCP shards tokens across dcp ranks: / dcp
    GQA: 2 x max(1, kv_heads / tp) x head_dim x bytes, / dcp

Linear-attention layers keep a fixed recurrent state per sequence (split over TP by
head), which DCP does not shard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from placement.devices import DEVICES, DeviceSpec
from placement.model_errors import InvalidEngineShape
from placement.model_spec import AttentionKind, ModelSpec, Shard, WeightGroup

__all__ = [
    "DEFAULT_MEMORY",
    "EngineMemoryConfig",
    "EngineShape",
    "FitReport",
    "MemoryPlan",
    "check_engine_shape",
    "devices_needed",
    "explain_dcp_degrees",
    "fits_on",
    "kv_bytes_per_token",
    "linear_state_bytes_per_sequence",
    "max_concurrent_sequences",
    "memory_plan",
    "valid_dcp_degrees",
    "valid_tp_degrees",
    "weight_bytes_per_gpu",
]

GiB = 2**30


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineShape:
    """Parallel layout of one engine. GPUs used: tp x pp (DCP reuses the TP ranks)."""

    tp: int = 1
    dcp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        if min(self.tp, self.dcp, self.pp) < 1:
            raise InvalidEngineShape(f"tp, dcp and pp must be >= 1; got {self}.")
        if self.tp % self.dcp:
            raise InvalidEngineShape(
                f"dcp={self.dcp} must divide tp={self.tp}: DCP shards the KV cache across "
                "the TP ranks. Pick a divisor of tp."
            )

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineMemoryConfig:
    """Engine settings that change memory, as vLLM names them."""

    gpu_memory_utilization: float = 0.9
    # Activations at the largest batch, CUDA graphs, sampler and communication buffers:
    # what vLLM's profiling run finds outside weights and KV cache on large models.
    activation_reserve_bytes: int = 4 * GiB
    kv_cache_dtype_bytes: int = 2  # "auto" (bf16); 1 for an fp8 KV cache
    include_mtp: bool = False  # load the MTP layers for speculative decoding
    max_num_seqs: int = 1024


DEFAULT_MEMORY = EngineMemoryConfig()


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryPlan:
    """Memory of one GPU of an engine; all byte figures are per GPU."""

    device: DeviceSpec
    shape: EngineShape
    weight_bytes: int
    activation_reserve_bytes: int
    kv_budget_bytes: int  # negative when the weights alone do not fit
    kv_bytes_per_token: float
    linear_state_bytes_per_sequence: float
    max_num_seqs: int

    @property
    def fits(self) -> bool:
        return self.kv_budget_bytes > 0

    def sequence_bytes(self, context_tokens: float) -> float:
        return context_tokens * self.kv_bytes_per_token + self.linear_state_bytes_per_sequence

    def max_concurrent_sequences(self, context_tokens: float) -> int:
        """Sequences of `context_tokens` whose KV fits at once (0 if none), capped at
        `max_num_seqs`."""
        if not self.fits:
            return 0
        per_sequence = self.sequence_bytes(context_tokens)
        if per_sequence <= 0:
            return self.max_num_seqs
        return min(self.max_num_seqs, int(self.kv_budget_bytes // per_sequence))

    def max_context_tokens(self, num_sequences: int = 1) -> int:
        """Longest context that `num_sequences` sequences can each hold at once."""
        if not self.fits or num_sequences < 1 or self.kv_bytes_per_token <= 0:
            return 0
        per_sequence = self.kv_budget_bytes / num_sequences - self.linear_state_bytes_per_sequence
        return max(0, int(per_sequence // self.kv_bytes_per_token))


def valid_tp_degrees(spec: ModelSpec, max_tp: int = 128) -> tuple[int, ...]:
    """TP degrees the engine accepts: heads split evenly, KV heads split or replicated
    evenly, linear-attention heads and experts split evenly."""
    return tuple(tp for tp in range(1, max_tp + 1) if _tp_problem(spec, tp) is None)


def valid_dcp_degrees(spec: ModelSpec, tp: int) -> tuple[int, ...]:
    """DCP degrees vLLM accepts at this TP.

    DCP shards the copies that TP makes of the KV cache, so it ranges over the
    replication factor: MLA caches one latent head, every TP rank holds a copy, and any
    divisor of tp works (`tp % dcp == 0`). GQA replicates only when tp exceeds the KV
    heads: `(tp // kv_heads) % dcp == 0`, so tp <= kv_heads allows only dcp = 1.
    """
    if spec.attention is AttentionKind.MLA or spec.num_full_attention_layers == 0:
        copies = tp if spec.attention is AttentionKind.MLA else 1
    else:
        copies = max(1, tp // spec.num_key_value_heads)
    return tuple(d for d in range(1, tp + 1) if tp % d == 0 and copies % d == 0)


def explain_dcp_degrees(spec: ModelSpec, tp: int) -> str:
    """One sentence saying which DCP degrees are valid at this TP, and why."""
    valid = ", ".join(str(d) for d in valid_dcp_degrees(spec, tp))
    if spec.num_full_attention_layers == 0:
        return f"no layer keeps a KV cache, so only dcp=1 applies (valid: {valid})."
    if spec.attention is AttentionKind.MLA:
        return (
            f"MLA caches one latent KV head, so all {tp} TP ranks hold a copy of it and "
            f"dcp may be any divisor of tp (tp % dcp == 0): {valid}."
        )
    kv = spec.num_key_value_heads
    if tp <= kv:
        return (
            f"with {kv} KV heads and tp={tp} each rank holds distinct KV heads, nothing is "
            f"replicated, so only dcp=1 is valid."
        )
    return (
        f"with {kv} KV heads, tp={tp} replicates each KV head {tp // kv} times; dcp must "
        f"divide that ((tp // kv_heads) % dcp == 0): {valid}."
    )


def check_engine_shape(spec: ModelSpec, shape: EngineShape) -> None:
    """Raise `InvalidEngineShape` if this model cannot run with this layout."""
    problem = _tp_problem(spec, shape.tp)
    if problem:
        raise InvalidEngineShape(f"tp={shape.tp} does not fit {spec.name}: {problem}.")
    if shape.dcp not in valid_dcp_degrees(spec, shape.tp):
        raise InvalidEngineShape(
            f"dcp={shape.dcp} is not valid for {spec.name} at tp={shape.tp}: "
            f"{explain_dcp_degrees(spec, shape.tp)}"
        )
    if shape.pp > spec.num_hidden_layers:
        raise InvalidEngineShape(f"pp={shape.pp} exceeds the {spec.num_hidden_layers} layers.")


def kv_bytes_per_token(
    spec: ModelSpec,
    *,
    kv_dtype_bytes: int = 2,
    tp: int = 1,
    dcp: int = 1,
    include_mtp: bool = False,
) -> float:
    """KV cache bytes one token occupies on one GPU (tp=1, dcp=1: the whole model's)."""
    layers = spec.num_full_attention_layers + (spec.num_mtp_layers if include_mtp else 0)
    per_layer: float
    if spec.mla is not None:
        per_layer = spec.mla.latent_dim * kv_dtype_bytes  # replicated on every TP rank
    else:
        heads_per_rank = max(1.0, spec.num_key_value_heads / tp)
        per_layer = 2 * heads_per_rank * spec.head_dim * kv_dtype_bytes
    return layers * per_layer / dcp


def linear_state_bytes_per_sequence(spec: ModelSpec, *, tp: int = 1) -> float:
    """Recurrent and convolution state of one sequence on one GPU (not sharded by DCP)."""
    la = spec.linear_attention
    if la is None:
        return 0.0
    return spec.num_linear_attention_layers * la.state_bytes_per_layer() / min(tp, la.num_heads)


@lru_cache(maxsize=256)
def weight_bytes_per_gpu(spec: ModelSpec, shape: EngineShape, *, include_mtp: bool = False) -> int:
    """Weight bytes one GPU of the engine holds (the fullest pipeline stage)."""
    stage_share = _stage_share(spec, shape.pp)
    total = 0.0
    for group in spec.weight_groups(include_mtp=include_mtp):
        share = _shard_share(spec, group, shape.tp)
        if 0 <= group.layer < spec.num_hidden_layers:
            share *= stage_share
        total += spec.group_bytes(group) * share
    return math.ceil(total)


def memory_plan(
    spec: ModelSpec,
    device: DeviceSpec,
    shape: EngineShape,
    memory: EngineMemoryConfig = DEFAULT_MEMORY,
) -> MemoryPlan:
    """Per-GPU memory of `spec` on `device` with `shape`."""
    check_engine_shape(spec, shape)
    weights = weight_bytes_per_gpu(spec, shape, include_mtp=memory.include_mtp)
    budget = int(device.memory_bytes * memory.gpu_memory_utilization)
    stage_share = _stage_share(spec, shape.pp)  # the fullest stage's share of the layers
    kv = stage_share * kv_bytes_per_token(
        spec,
        kv_dtype_bytes=memory.kv_cache_dtype_bytes,
        tp=shape.tp,
        dcp=shape.dcp,
        include_mtp=memory.include_mtp,
    )
    state = stage_share * linear_state_bytes_per_sequence(spec, tp=shape.tp)
    return MemoryPlan(
        device=device,
        shape=shape,
        weight_bytes=weights,
        activation_reserve_bytes=memory.activation_reserve_bytes,
        kv_budget_bytes=budget - weights - memory.activation_reserve_bytes,
        kv_bytes_per_token=kv,
        linear_state_bytes_per_sequence=state,
        max_num_seqs=memory.max_num_seqs,
    )


def max_concurrent_sequences(
    spec: ModelSpec,
    device: DeviceSpec,
    shape: EngineShape,
    context_tokens: float,
    memory: EngineMemoryConfig = DEFAULT_MEMORY,
) -> int:
    """Sequences of `context_tokens` one engine holds at once (0 if it does not fit)."""
    return memory_plan(spec, device, shape, memory).max_concurrent_sequences(context_tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class FitReport:
    """Answer to "does it fit": the smallest single device, else a count of the largest.

    `per_device` lists, for every catalog device, the smallest engine shape that holds
    the model with the requested sequences (None: no shape up to 128 GPUs does)."""

    smallest_single: DeviceSpec | None
    largest: DeviceSpec
    largest_shape: EngineShape | None
    per_device: tuple[tuple[DeviceSpec, EngineShape | None], ...]

    @property
    def num_largest(self) -> int | None:
        return None if self.largest_shape is None else self.largest_shape.num_gpus


def devices_needed(
    spec: ModelSpec,
    device: DeviceSpec,
    *,
    context_tokens: int = 0,
    num_sequences: int = 1,
    memory: EngineMemoryConfig = DEFAULT_MEMORY,
    max_gpus: int = 128,
) -> EngineShape | None:
    """Smallest engine on `device` that holds the weights plus `num_sequences`
    sequences of `context_tokens`: the smallest valid TP inside one scale-up domain,
    else that domain's largest TP times the fewest pipeline stages (None: nothing up
    to `max_gpus` GPUs does)."""
    tps = [tp for tp in valid_tp_degrees(spec, max_tp=max_gpus) if tp <= device.nvlink_domain_size]
    widest = max(tps, default=1)
    shapes = [EngineShape(tp=tp) for tp in tps]
    shapes += [
        EngineShape(tp=widest, pp=pp)
        for pp in range(2, max_gpus // widest + 1)
        if pp <= spec.num_hidden_layers
    ]
    for shape in shapes:
        plan = memory_plan(spec, device, shape, memory)
        if plan.fits and plan.max_concurrent_sequences(context_tokens) >= num_sequences:
            return shape
    return None


def fits_on(
    spec: ModelSpec,
    devices: Sequence[DeviceSpec] = DEVICES,
    *,
    context_tokens: int = 0,
    num_sequences: int = 1,
    memory: EngineMemoryConfig = DEFAULT_MEMORY,
) -> FitReport:
    """The smallest device that holds the model alone, or how many of the largest."""
    per_device = tuple(
        (
            d,
            devices_needed(
                spec, d, context_tokens=context_tokens, num_sequences=num_sequences, memory=memory
            ),
        )
        for d in sorted(devices, key=lambda d: (d.memory_bytes, d.name))
    )
    single = next((d for d, shape in per_device if shape is not None and shape.num_gpus == 1), None)
    largest, largest_shape = per_device[-1]
    return FitReport(
        smallest_single=single, largest=largest, largest_shape=largest_shape, per_device=per_device
    )


def _stage_share(spec: ModelSpec, pp: int) -> float:
    return math.ceil(spec.num_hidden_layers / pp) / spec.num_hidden_layers


def _shard_share(spec: ModelSpec, group: WeightGroup, tp: int) -> float:
    if group.shard is Shard.REPLICATED:
        return 1.0
    if group.shard is Shard.KV_HEADS:
        return 1.0 / min(tp, spec.num_key_value_heads)
    return 1.0 / tp


def _tp_problem(spec: ModelSpec, tp: int) -> str | None:
    if spec.num_attention_heads % tp:
        return f"num_attention_heads={spec.num_attention_heads} is not divisible by tp"
    kv = spec.num_key_value_heads
    if spec.mla is None and (kv % tp if kv >= tp else tp % kv):
        return f"num_key_value_heads={kv} neither divides nor is divided by tp"
    la = spec.linear_attention
    if la is not None and (la.num_heads % tp or la.num_key_heads % tp):
        return (
            f"linear-attention heads ({la.num_key_heads} key, {la.num_heads} value) not divisible"
        )
    moe = spec.moe
    if moe is not None and moe.num_experts % tp and moe.moe_intermediate_size % tp:
        return f"neither num_experts={moe.num_experts} nor moe_intermediate_size divides by tp"
    return None
