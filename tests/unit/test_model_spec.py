"""Model specs read from real config.json files, checked against published figures."""

from __future__ import annotations

import pytest
from hf_configs import load, load_config

from placement.model_errors import UnsupportedModel
from placement.model_spec import AttentionKind, LinearAttentionKind, ModelSpec
from placement.quantization import QuantScheme, module_matches


def close(value: float, expected: float, rel: float) -> bool:
    return abs(value - expected) <= rel * expected


def test_deepseek_v3_shape_and_published_parameter_counts() -> None:
    spec = load("deepseek_v3")
    assert spec.attention is AttentionKind.MLA
    assert spec.mla is not None and spec.mla.latent_dim == 512 + 64
    # 61 layers: the first 3 dense (first_k_dense_replace), 58 MoE; one MTP module.
    assert spec.num_hidden_layers == 61
    assert spec.layer_is_moe.count(False) == 3
    assert spec.num_mtp_layers == 1
    # DeepSeek-V3 report: 671B total, 37B activated per token (the weights README:
    # 36.6B, 0.9B of it the output head); the HF checkpoint holds 685B with MTP.
    assert close(spec.num_params, 671e9, 0.005)
    assert close(spec.num_active_params, 36.6e9, 0.01)
    assert close(spec.num_active_params, 37e9, 0.02)
    assert close(spec.num_params_with_mtp, 685e9, 0.005)


def test_deepseek_v3_fp8_checkpoint_bytes_match_the_published_safetensors() -> None:
    spec = load("deepseek_v3")
    assert spec.quant.name == "fp8-block"
    assert spec.quant.block_shape == (128, 128)
    # deepseek-ai/DeepSeek-V3: the 163 safetensors shards add up to 688,586,727,753 bytes
    # (FP8 e4m3 weights with one fp32 scale per 128x128 block, bf16 embeddings, head,
    # norms and router, MTP layer 61 included).
    assert close(spec.weight_bytes(include_mtp=True), 688_586_727_753, 0.01)


def test_llama3_8b_is_a_dense_gqa_model_of_published_size() -> None:
    spec = load("llama3_8b")
    assert spec.attention is AttentionKind.GQA
    assert (spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim) == (32, 8, 128)
    assert spec.moe is None and not any(spec.layer_is_moe)
    # meta-llama/Meta-Llama-3-8B model.safetensors.index.json: total_size 16,060,522,496
    # bytes of bf16 weights, i.e. 8,030,261,248 parameters.
    assert spec.weight_bytes() == 16_060_522_496
    assert spec.num_params == 8_030_261_248


def test_kimi_k2_is_a_trillion_parameter_mla_moe() -> None:
    spec = load("kimi_k2")
    assert spec.attention is AttentionKind.MLA
    assert spec.moe is not None
    assert (spec.moe.num_experts, spec.moe.num_experts_per_tok) == (384, 8)
    assert spec.layer_is_moe.count(False) == 1  # first_k_dense_replace = 1
    assert spec.num_mtp_layers == 0
    # Moonshot: 1.04T total parameters, 32B activated.
    assert close(spec.num_params, 1.04e12, 0.02)
    assert close(spec.num_active_params, 32e9, 0.02)


def test_kimi_linear_hybrid_layout_from_linear_attn_config() -> None:
    spec = load("kimi_linear")
    # full_attn_layers are 1-based in the config: 4, 8, ..., 24 and 27.
    full = [i for i, linear in enumerate(spec.layer_is_linear) if not linear]
    assert full == [3, 7, 11, 15, 19, 23, 26]
    assert spec.num_linear_attention_layers == 20
    la = spec.linear_attention
    assert la is not None and la.kind is LinearAttentionKind.KDA
    assert (la.num_heads, la.key_head_dim, la.conv_kernel_size) == (32, 128, 4)
    assert spec.attention is AttentionKind.MLA and spec.mla is not None
    assert spec.mla.q_lora_rank is None
    # Kimi-Linear-48B-A3B: 48B total, 3B activated.
    assert 47e9 <= spec.num_params <= 50e9
    assert 2.5e9 <= spec.num_active_params <= 3.5e9


def test_qwen3_next_hybrid_layout_and_size() -> None:
    spec = load("qwen3_next")
    # Every 4th layer is gated full attention, the rest gated DeltaNet.
    assert spec.num_full_attention_layers == 12
    assert [i for i, lin in enumerate(spec.layer_is_linear) if not lin][:3] == [3, 7, 11]
    la = spec.linear_attention
    assert la is not None and la.kind is LinearAttentionKind.GATED_DELTANET
    assert (la.num_heads, la.num_key_heads, la.key_head_dim, la.value_head_dim) == (
        32,
        16,
        128,
        128,
    )
    assert spec.attn_output_gate
    # Qwen3-Next-80B-A3B: 80B total, about 3B activated.
    assert close(spec.num_params, 80e9, 0.01)
    assert 3e9 <= spec.num_active_params <= 4e9
    # The same layout from full_attention_interval alone (older config revisions).
    config = load_config("qwen3_next")
    del config["layer_types"]
    assert ModelSpec.from_hf_config(config).layer_is_linear == spec.layer_is_linear


def test_ling_linear_layer_groups() -> None:
    # Ring/Ling linear: the last layer of each group of layer_group_size is full attention.
    config = load_config("llama3_8b") | {
        "num_hidden_layers": 20,
        "layer_group_size": 5,
        "model_type": "bailing_moe_linear",
    }
    spec = ModelSpec.from_hf_config(config)
    assert [i for i, lin in enumerate(spec.layer_is_linear) if not lin] == [4, 9, 14, 19]
    assert spec.linear_attention is not None
    assert spec.linear_attention.kind is LinearAttentionKind.LIGHTNING


def test_multimodal_wrapper_reads_text_config() -> None:
    wrapped = {"model_type": "kimi_k25", "text_config": load_config("kimi_k2")}
    assert ModelSpec.from_hf_config(wrapped).num_params == load("kimi_k2").num_params


def test_block_fp8_scales_one_fp32_per_128x128_block() -> None:
    fp8 = QuantScheme.from_hf(load_config("deepseek_v3")["quantization_config"], dtype_bytes=2)
    # A 7168 x 18432 matrix: 56 x 144 blocks of 128 x 128.
    assert fp8.matrix_bytes(7168, 18432) == 7168 * 18432 + 56 * 144 * 4
    # Ragged edges round up to whole blocks: 576 rows are 5 blocks.
    assert fp8.matrix_bytes(576, 7168) == 576 * 7168 + 5 * 56 * 4


def test_group_quantization_formats() -> None:
    rows, cols = 7168, 2048
    int4 = QuantScheme.from_hf(
        {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "group_size": 32,
                        "symmetric": True,
                        "strategy": "group",
                    },
                }
            },
        },
        dtype_bytes=2,
    )
    # Half a byte per weight, a bf16 scale per 32 inputs, no zero point.
    assert int4.matrix_bytes(rows, cols) == rows * cols // 2 + rows * (cols // 32) * 2
    awq = QuantScheme.from_hf({"quant_method": "awq", "bits": 4, "group_size": 128}, dtype_bytes=2)
    # AWQ is asymmetric: a 4-bit zero point per group beside the fp16 scale.
    groups = rows * cols // 128
    assert awq.matrix_bytes(rows, cols) == rows * cols // 2 + groups * 2 + groups // 2
    mxfp4 = QuantScheme.from_hf({"quant_method": "mxfp4"}, dtype_bytes=2)
    assert mxfp4.matrix_bytes(rows, cols) == rows * cols // 2 + rows * cols // 32  # e8m0 / 32
    nvfp4 = QuantScheme.from_hf({"quant_method": "modelopt", "quant_algo": "NVFP4"}, dtype_bytes=2)
    # fp8 scale per 16 inputs plus the fp32 global scale and input scale of the tensor.
    assert nvfp4.matrix_bytes(rows, cols) == rows * cols // 2 + rows * cols // 16 + 8


def test_ignore_lists_keep_modules_in_bf16() -> None:
    config = load_config("kimi_k2") | {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "ignore": [
                "lm_head",
                "re:.*self_attn.*",
                "re:.*shared_experts.*",
                "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
            ],
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4, "type": "int", "group_size": 32, "symmetric": True},
                }
            },
        }
    }
    spec = ModelSpec.from_hf_config(config)
    by_module = {g.module: g for g in spec.weight_groups()}
    attention = by_module["model.layers.5.self_attn.o_proj"]
    assert spec.group_bytes(attention) == attention.num_params * 2
    dense = by_module["model.layers.0.mlp.up_proj"]
    assert spec.group_bytes(dense) == dense.num_params * 2
    experts = by_module["model.layers.5.mlp.experts.0.up_proj"]
    assert spec.group_bytes(experts) < experts.num_params  # ~4.5 bits per weight
    # Int4 routed experts, bf16 everything else: the layout of moonshotai/Kimi-K2-Thinking,
    # whose download is about 594 GB (against ~1.03 TB for the FP8 Kimi K2).
    assert close(spec.weight_bytes(), 594e9, 0.02)
    assert module_matches("re:.*self_attn.*", "model.layers.1.self_attn.q_a_proj")
    assert not module_matches("re:.*self_attn.*", "model.layers.1.mlp.gate")


def test_unreadable_configs_name_the_field() -> None:
    config = load_config("llama3_8b")
    del config["hidden_size"]
    with pytest.raises(UnsupportedModel, match="'hidden_size'"):
        ModelSpec.from_hf_config(config)
    odd = load_config("llama3_8b") | {"quantization_config": {"quant_method": "hqq"}}
    with pytest.raises(UnsupportedModel, match="'hqq'"):
        ModelSpec.from_hf_config(odd)


def test_every_error_of_placement_has_one_root() -> None:
    import inspect

    from placement import errors, model_errors

    raised = [
        cls
        for module in (errors, model_errors)
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, Exception) and cls.__module__ == module.__name__
    ]
    assert len(raised) >= 12
    assert all(issubclass(cls, errors.PlacementError) for cls in raised), raised
    # ...and the capacity model's are still the built-in kinds callers catch.
    assert issubclass(model_errors.UnknownDevice, LookupError)
    assert issubclass(model_errors.UnsupportedModel, ValueError)
