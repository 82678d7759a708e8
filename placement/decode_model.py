"""The decode model: how long one decode step takes, and tokens per second.

One step emits a token for each of `batch_size` sequences of `context_tokens`. Per GPU:

    memory_s  = (weights read + KV read + linear state read/written) / (bandwidth x eff)
    compute_s = (2 x active params x tokens + attention FLOPs) / (TFLOPS x eff)
    step_s    = max(memory_s, compute_s)
              + layers x layer_fixed_s                      kernels at small batch
              + layers x 2 x all-reduce(tp)                 TP communication
              + attention layers x 2 x collective(dcp)      DCP: all-gather the queries,
                                                            merge partial outputs by LSE
              + step_fixed_s                                scheduling and sampling

Weights read: everything the GPU holds, except routed experts, of which a step reads
the share its tokens touch, 1 - (1 - k/E)^tokens under uniform routing (k of E at
batch 1, nearly all at large batch). KV read: each sequence's cache as this GPU holds
it, so TP's replicated copies of an MLA cache are read on every rank and DCP divides
the read by dcp. The fixed costs are calibration constants (`DecodeCalibration`),
not datasheet figures: they are the order of magnitude vLLM shows with CUDA graphs and
are meant to be refined from measurements.

Speculative decoding (MTP): each step verifies `num_draft_tokens` extra tokens per
sequence and emits `acceptance_length` tokens on average; the drafts cost one pass of
the MTP layers each.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from placement.capacity import (
    DEFAULT_MEMORY,
    EngineMemoryConfig,
    EngineShape,
    check_engine_shape,
    kv_bytes_per_token,
    linear_state_bytes_per_sequence,
)
from placement.devices import DeviceSpec
from placement.model_spec import ModelSpec, Shard

__all__ = [
    "DecodeCalibration",
    "DecodeEstimate",
    "SpeculativeConfig",
    "calibration_for",
    "decode_step",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeCalibration:
    """Efficiencies and fixed costs of one device class; estimates to be measured."""

    bandwidth_efficiency: float = 0.75  # share of peak memory bandwidth decode reaches
    compute_efficiency: float = 0.5
    layer_fixed_s: float = 100e-6  # launches and latency-bound kernels per layer per step
    collective_latency_s: float = 10e-6  # one small collective inside a scale-up domain
    scale_out_latency_s: float = 30e-6  # one small collective across domains
    step_fixed_s: float = 1e-3  # scheduling, sampling, output processing per step


_CALIBRATIONS: dict[str, DecodeCalibration] = {
    "b200": DecodeCalibration(layer_fixed_s=80e-6, collective_latency_s=8e-6),
    "gb200": DecodeCalibration(layer_fixed_s=80e-6, collective_latency_s=8e-6),
    "gb300": DecodeCalibration(layer_fixed_s=80e-6, collective_latency_s=8e-6),
    "mi355x": DecodeCalibration(layer_fixed_s=120e-6, collective_latency_s=15e-6),
    "m3-ultra-512gb": DecodeCalibration(
        bandwidth_efficiency=0.6, layer_fixed_s=200e-6, scale_out_latency_s=100e-6
    ),
    "cpu-host": DecodeCalibration(
        bandwidth_efficiency=0.5,
        compute_efficiency=0.3,
        layer_fixed_s=300e-6,
        scale_out_latency_s=100e-6,
    ),
}


def calibration_for(device: DeviceSpec) -> DecodeCalibration:
    """The default calibration of a catalog device (Hopper-class values otherwise)."""
    return _CALIBRATIONS.get(device.name, DecodeCalibration())


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeConfig:
    num_draft_tokens: int = 1
    acceptance_length: float = 1.8  # tokens emitted per step, the verified bonus included


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeEstimate:
    """One decode step of one engine; byte figures are per GPU."""

    batch_size: int
    context_tokens: float
    weight_bytes_read: float
    kv_bytes_read: float
    state_bytes_read: float
    memory_s: float
    compute_s: float
    fixed_s: float
    tp_comm_s: float
    dcp_comm_s: float
    draft_s: float
    step_s: float
    tokens_per_step: float  # per sequence
    num_gpus: int

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s > self.memory_s else "memory"

    @property
    def tokens_per_s_per_user(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.batch_size * self.tokens_per_s_per_user

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.num_gpus


def decode_step(
    spec: ModelSpec,
    device: DeviceSpec,
    shape: EngineShape,
    *,
    batch_size: int,
    context_tokens: float,
    memory: EngineMemoryConfig = DEFAULT_MEMORY,
    calibration: DecodeCalibration | None = None,
    speculative: SpeculativeConfig | None = None,
) -> DecodeEstimate:
    """Time of one decode step; does not check that the batch fits (see `capacity`).

    Pipeline stages run one after another for a step (no micro-batch overlap), so
    latency is that of a tp-GPU engine reading every layer, and throughput per GPU
    divides by tp x pp.
    """
    check_engine_shape(spec, shape)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}.")
    cal = calibration or calibration_for(device)
    tokens_per_seq = 1 + (speculative.num_draft_tokens if speculative else 0)
    step_tokens = batch_size * tokens_per_seq
    tp = shape.tp

    weights = _weight_bytes_read(spec, tp, step_tokens, include_mtp=False)
    kv_per_token = kv_bytes_per_token(
        spec, kv_dtype_bytes=memory.kv_cache_dtype_bytes, tp=tp, dcp=shape.dcp
    )
    kv = batch_size * context_tokens * kv_per_token
    state = 2 * batch_size * linear_state_bytes_per_sequence(spec, tp=tp)
    bandwidth = device.memory_bandwidth_gbps * 1e9 * cal.bandwidth_efficiency
    memory_s = (weights + kv + state) / bandwidth
    compute_s = (
        _flops(spec, step_tokens, context_tokens)
        / tp
        / (device.bf16_dense_tflops * 1e12 * cal.compute_efficiency)
    )

    layers = spec.num_hidden_layers
    fixed_s = layers * cal.layer_fixed_s + cal.step_fixed_s
    tp_comm_s = 0.0
    if tp > 1:
        allreduce_bytes = step_tokens * spec.hidden_size * 2 * 2 * (tp - 1) / tp
        tp_comm_s = layers * 2 * _collective_s(device, cal, tp, allreduce_bytes)
    dcp_comm_s = 0.0
    if shape.dcp > 1:
        dcp_bytes = _dcp_bytes_per_layer(spec, shape, step_tokens)
        dcp_comm_s = (
            spec.num_full_attention_layers
            * 2
            * _collective_s(device, cal, shape.dcp, dcp_bytes / 2)
        )

    draft_s = 0.0
    if speculative and spec.num_mtp_layers:
        # One MTP pass per draft token: its layers' weights, its attention's KV, its head.
        mtp_weights = _weight_bytes_read(
            spec, tp, batch_size, include_mtp=True
        ) - _weight_bytes_read(spec, tp, batch_size, include_mtp=False)
        per_draft = (mtp_weights + kv / max(1, spec.num_full_attention_layers)) / bandwidth
        per_draft += spec.num_mtp_layers * cal.layer_fixed_s
        draft_s = speculative.num_draft_tokens * per_draft
    step_s = max(memory_s, compute_s) + fixed_s + tp_comm_s + dcp_comm_s + draft_s
    return DecodeEstimate(
        batch_size=batch_size,
        context_tokens=context_tokens,
        weight_bytes_read=weights,
        kv_bytes_read=kv,
        state_bytes_read=state,
        memory_s=memory_s,
        compute_s=compute_s,
        fixed_s=fixed_s,
        tp_comm_s=tp_comm_s,
        dcp_comm_s=dcp_comm_s,
        draft_s=draft_s,
        step_s=step_s,
        tokens_per_step=speculative.acceptance_length if speculative else 1.0,
        num_gpus=shape.num_gpus,
    )


def _weight_bytes_read(spec: ModelSpec, tp: int, step_tokens: int, *, include_mtp: bool) -> float:
    dense, experts, fraction = _weight_profile(spec, tp, include_mtp)
    return dense + experts * (1.0 - (1.0 - fraction) ** step_tokens)


@lru_cache(maxsize=256)
def _weight_profile(spec: ModelSpec, tp: int, include_mtp: bool) -> tuple[float, float, float]:
    """Per-GPU bytes every step reads, per-GPU routed-expert bytes, and k / E."""
    dense = experts = 0.0
    fraction = 0.0
    for group in spec.weight_groups(include_mtp=include_mtp):
        if group.active_fraction == 0.0:
            continue  # embedding rows: a lookup, not a read of the table
        share = 1.0
        if group.shard is Shard.KV_HEADS:
            share = 1.0 / min(tp, spec.num_key_value_heads)
        elif group.shard is not Shard.REPLICATED:
            share = 1.0 / tp
        if group.shard is Shard.EXPERTS:
            experts += spec.group_bytes(group) * share
            fraction = group.active_fraction
        else:
            dense += spec.group_bytes(group) * share
    return dense, experts, fraction


def _flops(spec: ModelSpec, step_tokens: int, context_tokens: float) -> float:
    """FLOPs of one step over the whole engine: matmuls plus attention over the context."""
    matmul = 2.0 * spec.num_active_params * step_tokens
    heads = spec.num_attention_heads
    if spec.mla is not None:  # absorbed MLA: scores over the latent, values in kv_lora space
        per_token_layer = (
            2.0 * heads * context_tokens * (spec.mla.latent_dim + spec.mla.kv_lora_rank)
        )
    else:
        per_token_layer = 4.0 * heads * context_tokens * spec.head_dim
    attention = per_token_layer * spec.num_full_attention_layers * step_tokens
    la = spec.linear_attention
    linear = 0.0
    if la is not None:
        linear = 4.0 * la.num_heads * la.key_head_dim * la.value_head_dim
        linear *= spec.num_linear_attention_layers * step_tokens
    return matmul + attention + linear


def _dcp_bytes_per_layer(spec: ModelSpec, shape: EngineShape, step_tokens: int) -> float:
    """Bytes one rank moves per attention layer: its share of the gathered queries, and
    the partial outputs (with one fp32 LSE per head) it exchanges for the merge."""
    heads_per_rank = spec.num_attention_heads / shape.tp
    if spec.mla is not None:
        q_dim, out_dim = spec.mla.latent_dim, spec.mla.kv_lora_rank
    else:
        q_dim = out_dim = spec.head_dim
    others = (shape.dcp - 1) / shape.dcp
    gathered_heads = heads_per_rank * shape.dcp
    queries = step_tokens * gathered_heads * q_dim * 2 * others
    outputs = step_tokens * gathered_heads * (out_dim * 2 + 4) * others
    return queries + outputs


def _collective_s(
    device: DeviceSpec, cal: DecodeCalibration, ranks: int, bytes_moved: float
) -> float:
    if ranks <= device.nvlink_domain_size:
        # Vendors quote both directions added; a collective moves data one way per link.
        return cal.collective_latency_s + bytes_moved / (
            device.interconnect_bandwidth_gbps * 1e9 / 2
        )
    return cal.scale_out_latency_s + bytes_moved / (device.scale_out_bandwidth_gbps * 1e9 / 2)
