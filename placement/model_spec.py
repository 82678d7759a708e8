"""What a model is, read from its Hugging Face `config.json`: shapes, layers, weights.

`ModelSpec.from_hf_config(config)` understands dense and MoE models (routed, shared
and leading dense layers), GQA/MHA and MLA attention, hybrid linear attention (Kimi
Linear's KDA, Qwen3-Next's gated DeltaNet, Ling's lightning attention), MTP layers
and the checkpoint's quantization. `weight_groups()` lists every stored weight as a
`WeightGroup` with its shape, how tensor parallelism splits it and whether it is
quantized; parameter counts and byte counts are sums over that list, so the memory
model and the decode model read the same numbers.

Module names follow the DeepSeek/Llama layout (`model.layers.3.mlp.experts.0.up_proj`)
so that a checkpoint's ignore patterns can be matched against them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from typing import Any

from placement.quantization import QuantScheme

__all__ = [
    "AttentionKind",
    "LinearAttentionKind",
    "LinearAttentionSpec",
    "MLASpec",
    "MoESpec",
    "ModelSpec",
    "Shard",
    "WeightGroup",
]


class AttentionKind(StrEnum):
    GQA = "gqa"  # MHA and MQA are GQA with num_key_value_heads = heads or 1
    MLA = "mla"


class LinearAttentionKind(StrEnum):
    KDA = "kda"  # Kimi Delta Attention (Kimi Linear)
    GATED_DELTANET = "gated_deltanet"  # Qwen3-Next
    LIGHTNING = "lightning"  # Ling/Ring linear (Bailing)


class Shard(StrEnum):
    """How tensor parallelism splits a weight across `tp` ranks."""

    TP = "tp"  # split evenly (heads, intermediate, vocab)
    KV_HEADS = "kv_heads"  # split by KV heads, replicated once tp > num_key_value_heads
    EXPERTS = "experts"  # routed experts, EP = TP (or each expert TP-sharded: same bytes)
    REPLICATED = "replicated"  # every rank holds a copy (norms, router, MLA down-projections)


@dataclass(frozen=True, slots=True, kw_only=True)
class MLASpec:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def latent_dim(self) -> int:
        """Elements cached per token per layer: the compressed KV plus the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True, kw_only=True)
class LinearAttentionSpec:
    """A recurrent layer whose per-sequence state does not grow with context."""

    kind: LinearAttentionKind
    num_heads: int  # value heads (the recurrent state has one matrix per value head)
    num_key_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int
    state_dtype_bytes: int = 4  # recurrent state is kept in fp32

    @property
    def conv_dim(self) -> int:
        if self.kind is LinearAttentionKind.LIGHTNING:
            return 0
        return 2 * self.num_key_heads * self.key_head_dim + self.num_heads * self.value_head_dim

    def state_bytes_per_layer(self, conv_dtype_bytes: int = 2) -> int:
        """Recurrent state plus the short-convolution window of one sequence."""
        recurrent = (
            self.num_heads * self.key_head_dim * self.value_head_dim * self.state_dtype_bytes
        )
        conv = self.conv_dim * max(0, self.conv_kernel_size - 1) * conv_dtype_bytes
        return recurrent + conv


@dataclass(frozen=True, slots=True, kw_only=True)
class MoESpec:
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    moe_intermediate_size: int
    shared_intermediate_size: int  # all shared experts together


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightGroup:
    """`count` stored matrices of shape (rows = out, cols = in) of one module."""

    module: str
    layer: int  # -1 for embeddings, final norm and lm_head
    rows: int
    cols: int
    count: int = 1
    shard: Shard = Shard.TP
    quantizable: bool = True
    active_fraction: float = 1.0  # share of these weights a token reads

    @property
    def num_params(self) -> int:
        return self.rows * self.cols * self.count


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A model's architecture and storage, independent of any engine layout."""

    name: str
    model_type: str
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention: AttentionKind
    mla: MLASpec | None = None
    attn_output_gate: bool = False
    intermediate_size: int
    moe: MoESpec | None = None
    layer_is_moe: tuple[bool, ...]  # one entry per main layer
    layer_is_linear: tuple[bool, ...]  # one entry per main layer
    linear_attention: LinearAttentionSpec | None = None
    num_mtp_layers: int = 0
    mtp_stores_embeddings: bool = False  # DeepSeek-style MTP layers carry embed + head copies
    dtype_bytes: int = 2
    quant: QuantScheme

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_is_moe)

    @property
    def num_full_attention_layers(self) -> int:
        return self.layer_is_linear.count(False)

    @property
    def num_linear_attention_layers(self) -> int:
        return self.layer_is_linear.count(True)

    @property
    def num_params(self) -> int:
        """Parameters of the main model (MTP layers excluded), as papers quote them."""
        return sum(g.num_params for g in self.weight_groups(include_mtp=False))

    @property
    def num_params_with_mtp(self) -> int:
        """Parameters stored in the checkpoint, MTP layers included."""
        return sum(g.num_params for g in self.weight_groups(include_mtp=True))

    @property
    def num_active_params(self) -> int:
        """Parameters one token reads in the main model: routed experts count k of E,
        the input embedding counts nothing (a row lookup), lm_head counts fully."""
        return _num_active_params(self)

    def group_bytes(self, group: WeightGroup) -> int:
        """Stored bytes of a weight group, quantization scales included."""
        quant = self.quant
        if group.quantizable and quant.is_quantized and not quant.keeps_unquantized(group.module):
            return quant.matrix_bytes(group.rows, group.cols) * group.count
        return group.num_params * self.dtype_bytes

    def weight_bytes(self, *, include_mtp: bool = True) -> int:
        """Bytes of all weights; with MTP this is the checkpoint's safetensors total."""
        return sum(self.group_bytes(g) for g in self.weight_groups(include_mtp=include_mtp))

    def weight_groups(self, *, include_mtp: bool = True) -> tuple[WeightGroup, ...]:
        """Every stored weight; memoized, since planners ask for it many times."""
        return _weight_groups(self, include_mtp)

    def _build_weight_groups(self, include_mtp: bool) -> tuple[WeightGroup, ...]:
        h, vocab = self.hidden_size, self.vocab_size
        groups = [
            _plain("model.embed_tokens", -1, vocab, h, shard=Shard.TP, active=0.0),
            _plain("model.norm", -1, 1, h),
        ]
        if not self.tie_word_embeddings:
            groups.append(_plain("lm_head", -1, vocab, h, shard=Shard.TP))
        for i, (linear, moe) in enumerate(
            zip(self.layer_is_linear, self.layer_is_moe, strict=True)
        ):
            groups += self._layer_groups(i, linear=linear, moe=moe)
        for i in range(self.num_hidden_layers, self.num_hidden_layers + self.num_mtp_layers):
            if include_mtp:
                groups += self._mtp_groups(i)
        return tuple(groups)

    def _layer_groups(self, i: int, *, linear: bool, moe: bool) -> list[WeightGroup]:
        norms = _plain(f"model.layers.{i}.input_layernorm", i, 2, self.hidden_size)
        attn = self._linear_attention_groups(i) if linear else self._attention_groups(i)
        return [norms, *attn, *(self._moe_groups(i) if moe else self._dense_mlp_groups(i))]

    def _mtp_groups(self, i: int) -> list[WeightGroup]:
        h, p = self.hidden_size, f"model.layers.{i}"
        # eh_proj is a plain replicated Linear in vLLM; the checkpoint keeps it unquantized.
        groups = [_plain(f"{p}.eh_proj", i, h, 2 * h), _plain(f"{p}.enorm", i, 3, h)]
        groups += self._layer_groups(i, linear=False, moe=self.moe is not None)
        if self.mtp_stores_embeddings:
            groups.append(
                _plain(f"{p}.embed_tokens", i, self.vocab_size, h, shard=Shard.TP, active=0)
            )
            groups.append(_plain(f"{p}.shared_head.head", i, self.vocab_size, h, shard=Shard.TP))
        return groups

    def _attention_groups(self, i: int) -> list[WeightGroup]:
        h, heads, p = self.hidden_size, self.num_attention_heads, f"model.layers.{i}.self_attn"
        if self.mla is None:
            d, kv = self.head_dim, self.num_key_value_heads
            q_rows = heads * d * (2 if self.attn_output_gate else 1)
            return _mats(p, i, [
                ("q_proj", q_rows, h, Shard.TP), ("k_proj", kv * d, h, Shard.KV_HEADS),
                ("v_proj", kv * d, h, Shard.KV_HEADS), ("o_proj", h, heads * d, Shard.TP),
            ])  # fmt: skip
        m = self.mla
        qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            shapes = [("q_a_proj", m.q_lora_rank, h, Shard.REPLICATED),
                      ("q_b_proj", heads * qk_dim, m.q_lora_rank, Shard.TP)]  # fmt: skip
        else:
            shapes = [("q_proj", heads * qk_dim, h, Shard.TP)]
        kv_b_rows = heads * (m.qk_nope_head_dim + m.v_head_dim)
        return _mats(p, i, [
            *shapes, ("kv_a_proj_with_mqa", m.latent_dim, h, Shard.REPLICATED),
            ("kv_b_proj", kv_b_rows, m.kv_lora_rank, Shard.TP),
            ("o_proj", h, heads * m.v_head_dim, Shard.TP),
        ])  # fmt: skip

    def _linear_attention_groups(self, i: int) -> list[WeightGroup]:
        la = self.linear_attention
        assert la is not None, "layer_is_linear set without a linear_attention spec"
        kind = la.kind
        # Module names as the checkpoints spell them, so ignore patterns match.
        prefix = {LinearAttentionKind.GATED_DELTANET: "linear_attn",
                  LinearAttentionKind.KDA: "self_attn"}.get(kind, "attention")  # fmt: skip
        h, p = self.hidden_size, f"model.layers.{i}.{prefix}"
        key_dim, value_dim = la.num_key_heads * la.key_head_dim, la.num_heads * la.value_head_dim
        if kind is LinearAttentionKind.GATED_DELTANET:
            shapes = [("in_proj_qkvz", 2 * key_dim + 2 * value_dim, h, Shard.TP),
                      ("in_proj_ba", 2 * la.num_heads, h, Shard.TP)]  # fmt: skip
        elif kind is LinearAttentionKind.KDA:
            rank = la.key_head_dim  # low-rank decay and output gates
            shapes = [
                ("q_proj", key_dim, h, Shard.TP), ("k_proj", key_dim, h, Shard.TP),
                ("v_proj", value_dim, h, Shard.TP), ("f_a_proj", rank, h, Shard.REPLICATED),
                ("f_b_proj", key_dim, rank, Shard.TP), ("g_a_proj", rank, h, Shard.REPLICATED),
                ("g_b_proj", value_dim, rank, Shard.TP), ("b_proj", la.num_heads, h, Shard.TP),
            ]  # fmt: skip
        else:
            shapes = [("query_key_value", 2 * key_dim + value_dim, h, Shard.TP),
                      ("g_proj", value_dim, h, Shard.TP)]  # fmt: skip
        out = "out_proj" if kind is LinearAttentionKind.GATED_DELTANET else "o_proj"
        conv_params = la.conv_dim * la.conv_kernel_size + 2 * la.num_heads + la.value_head_dim
        return [
            *_mats(p, i, [*shapes, (out, h, value_dim, Shard.TP)]),
            _plain(f"{p}.conv1d", i, 1, conv_params, shard=Shard.TP),
        ]

    def _dense_mlp_groups(self, i: int) -> list[WeightGroup]:
        h, inter = self.hidden_size, self.intermediate_size
        return _mats(f"model.layers.{i}.mlp", i, _swiglu(inter, h))

    def _moe_groups(self, i: int) -> list[WeightGroup]:
        moe = self.moe
        assert moe is not None, "layer_is_moe set without a moe spec"
        h, p, e = self.hidden_size, f"model.layers.{i}.mlp", moe.num_experts
        routed = moe.num_experts_per_tok / e
        groups = [_plain(f"{p}.gate", i, e, h)]
        groups += [
            WeightGroup(module=f"{p}.experts.0.{name}", layer=i, rows=rows, cols=cols, count=e,
                        shard=Shard.EXPERTS, active_fraction=routed)
            for name, rows, cols, _ in _swiglu(moe.moe_intermediate_size, h)
        ]  # fmt: skip
        if moe.shared_intermediate_size:
            groups += _mats(f"{p}.shared_experts", i, _swiglu(moe.shared_intermediate_size, h))
        return groups

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], *, name: str = "") -> ModelSpec:
        """Read a `config.json` dict (multimodal wrappers: its `text_config`)."""
        from placement.hf_config import parse_hf_config

        return parse_hf_config(config, name=name)


def _plain(
    module: str, layer: int, rows: int, cols: int, *, shard: Shard = Shard.REPLICATED,
    active: float = 1.0,
) -> WeightGroup:  # fmt: skip
    """A weight that stays in the checkpoint dtype (embeddings, norms, routers, ...)."""
    return WeightGroup(module=module, layer=layer, rows=rows, cols=cols, shard=shard,
                       quantizable=False, active_fraction=active)  # fmt: skip


def _mats(prefix: str, layer: int, shapes: list[tuple[str, int, int, Shard]]) -> list[WeightGroup]:
    return [
        WeightGroup(module=f"{prefix}.{name}", layer=layer, rows=rows, cols=cols, shard=shard)
        for name, rows, cols, shard in shapes
    ]


def _swiglu(inter: int, hidden: int) -> list[tuple[str, int, int, Shard]]:
    return [("gate_proj", inter, hidden, Shard.TP), ("up_proj", inter, hidden, Shard.TP),
            ("down_proj", hidden, inter, Shard.TP)]  # fmt: skip


@lru_cache(maxsize=64)
def _weight_groups(spec: ModelSpec, include_mtp: bool) -> tuple[WeightGroup, ...]:
    return spec._build_weight_groups(include_mtp)


@lru_cache(maxsize=64)
def _num_active_params(spec: ModelSpec) -> int:
    groups = spec.weight_groups(include_mtp=False)
    return round(sum(g.num_params * g.active_fraction for g in groups))
