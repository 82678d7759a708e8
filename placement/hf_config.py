"""Reading a Hugging Face `config.json` dict into a `ModelSpec`.

Field names differ between model families; this module is the one place that knows
them. It reads what the published configs contain:

- DeepSeek-V3 / Kimi K2 (`deepseek_v3`, `kimi_k2`): MLA (`kv_lora_rank`, ...), MoE
  (`n_routed_experts`, `n_shared_experts`, `first_k_dense_replace`, `moe_layer_freq`),
  MTP (`num_nextn_predict_layers`), FP8 block quantization.
- Kimi Linear (`kimi_linear`): `linear_attn_config` with 1-based `full_attn_layers` /
  `kda_layers`, MoE as `num_experts` / `num_experts_per_token` / `num_shared_experts`.
- Qwen3-Next (`qwen3_next`): `layer_types` or `full_attention_interval`, gated
  DeltaNet (`linear_num_value_heads`, ...), `decoder_sparse_step`, `mlp_only_layers`,
  a gated attention output.
- Ling / Ring linear (`bailing_moe_linear`): `layer_group_size`.
- Llama and other dense GQA models.

Sliding-window layers are treated as full attention (an upper bound on their KV).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from placement.model_errors import UnsupportedModel
from placement.model_spec import (
    AttentionKind,
    LinearAttentionKind,
    LinearAttentionSpec,
    MLASpec,
    ModelSpec,
    MoESpec,
)
from placement.quantization import QuantScheme

__all__ = ["parse_hf_config"]

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
# Families whose MTP layers store their own copy of the embedding and output head.
_MTP_WITH_EMBEDDINGS = {"deepseek_v3", "deepseek_v32", "kimi_k2"}


def parse_hf_config(config: Mapping[str, Any], *, name: str = "") -> ModelSpec:
    """Build a `ModelSpec`; raises `UnsupportedModel` naming the missing or odd field."""
    top = dict(config)
    text = top.get("text_config")
    cfg: dict[str, Any] = {**top, **text} if isinstance(text, Mapping) else top
    model_type = str(cfg.get("model_type", ""))
    num_layers = _required(cfg, "num_hidden_layers")
    hidden = _required(cfg, "hidden_size")
    heads = _required(cfg, "num_attention_heads")
    dtype_bytes = _dtype_bytes(cfg)
    layer_is_linear, linear = _linear_layout(cfg, num_layers, heads)
    moe, layer_is_moe = _moe_layout(cfg, num_layers)
    if not all(layer_is_moe) and not cfg.get("intermediate_size"):
        raise UnsupportedModel(
            "config has dense MLP layers but no `intermediate_size`; add the field "
            "(the dense FFN width) to config.json."
        )
    quant_config = top.get("quantization_config") or cfg.get("quantization_config")
    num_mtp = int(cfg.get("num_nextn_predict_layers") or cfg.get("mtp_num_hidden_layers") or 0)
    return ModelSpec(
        name=name or str(cfg.get("_name_or_path") or model_type or "model"),
        model_type=model_type,
        hidden_size=hidden,
        vocab_size=_required(cfg, "vocab_size"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        attention=AttentionKind.MLA if cfg.get("kv_lora_rank") else AttentionKind.GQA,
        mla=_mla(cfg),
        attn_output_gate=bool(
            cfg.get("attn_output_gate", model_type.startswith(("qwen3_next", "qwen3_5")))
        ),
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        moe=moe,
        layer_is_moe=layer_is_moe,
        layer_is_linear=layer_is_linear,
        linear_attention=linear,
        num_mtp_layers=num_mtp,
        mtp_stores_embeddings=num_mtp > 0 and model_type in _MTP_WITH_EMBEDDINGS,
        dtype_bytes=dtype_bytes,
        quant=QuantScheme.from_hf(quant_config, dtype_bytes=dtype_bytes),
    )


def _required(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or value <= 0:
        raise UnsupportedModel(
            f"config.json field {key!r} is {value!r}; it must be a positive integer. "
            "Pass the model's own config.json (or its text_config)."
        )
    return value


def _dtype_bytes(cfg: Mapping[str, Any]) -> int:
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    if dtype not in _DTYPE_BYTES:
        raise UnsupportedModel(f"torch_dtype {dtype!r} is not one of {sorted(_DTYPE_BYTES)}.")
    return _DTYPE_BYTES[dtype]


def _mla(cfg: Mapping[str, Any]) -> MLASpec | None:
    if not cfg.get("kv_lora_rank"):
        return None
    rope = int(cfg.get("qk_rope_head_dim") or 0)
    nope = int(cfg.get("qk_nope_head_dim") or 0)
    if not rope or not nope:
        raise UnsupportedModel(
            "MLA config (kv_lora_rank set) needs qk_rope_head_dim and qk_nope_head_dim; "
            f"got {rope!r} and {nope!r}."
        )
    return MLASpec(
        q_lora_rank=int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(cfg.get("v_head_dim") or nope),
    )


def _linear_layout(
    cfg: Mapping[str, Any], num_layers: int, heads: int
) -> tuple[tuple[bool, ...], LinearAttentionSpec | None]:
    """Which layers are linear attention, and the spec of those layers."""
    lac = cfg.get("linear_attn_config")
    if isinstance(lac, Mapping):  # Kimi Linear: 1-based layer numbers
        full = {int(n) - 1 for n in lac.get("full_attn_layers") or ()}
        kda_heads, kda_dim = int(lac.get("num_heads") or heads), int(lac.get("head_dim") or 128)
        spec = LinearAttentionSpec(
            kind=LinearAttentionKind.KDA,
            num_heads=kda_heads,
            num_key_heads=kda_heads,
            key_head_dim=kda_dim,
            value_head_dim=kda_dim,
            conv_kernel_size=int(lac.get("short_conv_kernel_size") or 4),
        )
        return tuple(i not in full for i in range(num_layers)), spec
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        if len(types) < num_layers:
            raise UnsupportedModel(
                f"layer_types lists {len(types)} layers but num_hidden_layers is {num_layers}."
            )
        unknown = sorted(
            {t for t in types} - {"linear_attention", "full_attention", "sliding_attention"}
        )
        if unknown:
            raise UnsupportedModel(f"layer_types has unknown kinds {unknown}.")
        flags = tuple(t == "linear_attention" for t in types[:num_layers])
    elif cfg.get("full_attention_interval"):
        interval = int(cfg["full_attention_interval"])
        flags = tuple((i + 1) % interval != 0 for i in range(num_layers))
    elif cfg.get("layer_group_size") and int(cfg["layer_group_size"]) > 1:
        group = int(cfg["layer_group_size"])
        tail = num_layers // group * group
        flags = tuple(not ((i + 1) % group == 0 or i >= tail) for i in range(num_layers))
    else:
        return (False,) * num_layers, None
    if not any(flags):
        return flags, None
    if cfg.get("linear_num_value_heads"):
        state_bytes = 2 if str(cfg.get("mamba_ssm_dtype", "float32")) == "bfloat16" else 4
        spec = LinearAttentionSpec(
            kind=LinearAttentionKind.GATED_DELTANET,
            num_heads=int(cfg["linear_num_value_heads"]),
            num_key_heads=int(cfg.get("linear_num_key_heads") or cfg["linear_num_value_heads"]),
            key_head_dim=int(cfg.get("linear_key_head_dim") or 128),
            value_head_dim=int(cfg.get("linear_value_head_dim") or 128),
            conv_kernel_size=int(cfg.get("linear_conv_kernel_dim") or 4),
            state_dtype_bytes=state_bytes,
        )
    else:  # Ling/Ring lightning attention: one state matrix per attention head
        head_dim = int(cfg.get("head_dim") or _required(cfg, "hidden_size") // heads)
        spec = LinearAttentionSpec(
            kind=LinearAttentionKind.LIGHTNING,
            num_heads=heads,
            num_key_heads=heads,
            key_head_dim=head_dim,
            value_head_dim=head_dim,
            conv_kernel_size=0,
        )
    return flags, spec


def _moe_layout(cfg: Mapping[str, Any], num_layers: int) -> tuple[MoESpec | None, tuple[bool, ...]]:
    experts = int(
        cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    )
    if experts <= 1:
        return None, (False,) * num_layers
    top_k = int(cfg.get("num_experts_per_tok") or cfg.get("num_experts_per_token") or 0)
    inter = int(cfg.get("moe_intermediate_size") or 0)
    if top_k <= 0 or inter <= 0:
        raise UnsupportedModel(
            f"MoE config with {experts} experts needs num_experts_per_tok and "
            f"moe_intermediate_size; got {top_k!r} and {inter!r}."
        )
    shared = int(cfg.get("n_shared_experts") or cfg.get("num_shared_experts") or 0)
    shared_inter = int(
        cfg.get("shared_expert_intermediate_size")
        or cfg.get("moe_shared_expert_intermediate_size")
        or 0
    )
    if shared_inter and not shared:
        shared = 1
    elif shared and not shared_inter:
        shared_inter = shared * inter
    elif shared and shared_inter:
        shared_inter *= shared
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense_only = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    layer_is_moe = tuple(
        i >= first_dense and i % freq == 0 and (i + 1) % step == 0 and i not in dense_only
        for i in range(num_layers)
    )
    spec = MoESpec(
        num_experts=experts,
        num_experts_per_tok=top_k,
        num_shared_experts=shared,
        moe_intermediate_size=inter,
        shared_intermediate_size=shared_inter,
    )
    return spec, layer_is_moe
