"""The memory model, anchored on published cache layouts, checkpoint sizes and datasheets."""

from __future__ import annotations

import math

import pytest
from hf_configs import load

from placement.capacity import (
    EngineMemoryConfig,
    EngineShape,
    GiB,
    fits_on,
    kv_bytes_per_token,
    linear_state_bytes_per_sequence,
    max_concurrent_sequences,
    memory_plan,
    weight_bytes_per_gpu,
)
from placement.devices import DEVICES, device_by_name
from placement.model_errors import InvalidEngineShape, UnknownDevice


def test_kv_bytes_per_token_match_the_published_cache_layouts() -> None:
    # DeepSeek-V3 MLA: 61 layers x (kv_lora_rank 512 + rope 64) x 2 bytes.
    assert kv_bytes_per_token(load("deepseek_v3")) == 61 * 576 * 2 == 70_272
    # Llama-3-8B GQA: 32 layers x K and V x 8 heads x 128 x 2 bytes.
    assert kv_bytes_per_token(load("llama3_8b")) == 32 * 2 * 8 * 128 * 2 == 131_072
    # Hybrids cache only their full-attention layers: Qwen3-Next 12 of 48 (2 KV heads of
    # 256), Kimi Linear 7 MLA layers of 27.
    assert kv_bytes_per_token(load("qwen3_next")) == 12 * 2 * 2 * 256 * 2
    assert kv_bytes_per_token(load("kimi_linear")) == 7 * 576 * 2
    # An fp8 KV cache halves it.
    assert kv_bytes_per_token(load("deepseek_v3"), kv_dtype_bytes=1) == 35_136


def test_mla_cache_is_replicated_by_tp_and_sharded_by_dcp() -> None:
    spec = load("deepseek_v3")
    # One latent head: every TP rank holds the whole cache, whatever tp is.
    assert kv_bytes_per_token(spec, tp=8) == 70_272
    assert kv_bytes_per_token(spec, tp=8, dcp=8) == 70_272 / 8 == 8_784
    assert kv_bytes_per_token(spec, tp=16, dcp=16) == 4_392


def test_gqa_cache_splits_by_kv_head_then_replicates() -> None:
    spec = load("llama3_8b")
    assert kv_bytes_per_token(spec, tp=4) == 32 * 2 * 2 * 128 * 2  # 2 KV heads per rank
    assert kv_bytes_per_token(spec, tp=8) == 32 * 2 * 1 * 128 * 2
    assert kv_bytes_per_token(spec, tp=16) == 32 * 2 * 1 * 128 * 2  # 8 heads on 16 ranks: copies
    assert kv_bytes_per_token(spec, tp=16, dcp=2) == 32 * 2 * 1 * 128 * 2 / 2


def test_linear_attention_state_is_fixed_per_sequence() -> None:
    spec = load("qwen3_next")
    # 36 gated-DeltaNet layers: 32 value heads x 128 x 128 fp32 state, plus a 3-token
    # bf16 window of the 16x128 + 16x128 + 32x128 convolution channels.
    per_layer = 32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 3 * 2
    assert linear_state_bytes_per_sequence(spec) == 36 * per_layer
    assert linear_state_bytes_per_sequence(spec, tp=4) == 36 * per_layer / 4


def test_weights_per_gpu() -> None:
    llama = load("llama3_8b")
    assert weight_bytes_per_gpu(llama, EngineShape(tp=1)) == 16_060_522_496
    ds = load("deepseek_v3")
    # TP8 holds an eighth of everything but the small replicated parts (norms, router,
    # MLA down-projections), so a GPU holds a little over 1/8 of the 673 GB main model.
    per_gpu = weight_bytes_per_gpu(ds, EngineShape(tp=8))
    eighth = ds.weight_bytes(include_mtp=False) / 8
    assert eighth < per_gpu < 1.02 * eighth
    # Loading the MTP layer for speculative decoding costs about 15.4 GB / 8 more.
    with_mtp = weight_bytes_per_gpu(ds, EngineShape(tp=8), include_mtp=True)
    assert 1.5e9 < with_mtp - per_gpu < 2.5e9


def test_concurrency_follows_from_the_datasheet_and_the_checkpoint() -> None:
    llama = load("llama3_8b")
    h100 = device_by_name("h100-sxm")
    # 80 GB x 0.9, minus 16,060,522,496 bytes of weights and a 4 GiB reserve, in
    # sequences of 8,192 tokens x 131,072 bytes.
    budget = 0.9 * 80e9 - 16_060_522_496 - 4 * GiB
    expected = math.floor(budget / (8192 * 131_072))
    assert max_concurrent_sequences(llama, h100, EngineShape(), 8192) == expected
    # An fp8 KV cache doubles it (give or take the rounding).
    fp8 = EngineMemoryConfig(kv_cache_dtype_bytes=1)
    assert max_concurrent_sequences(llama, h100, EngineShape(), 8192, fp8) in (
        2 * expected,
        2 * expected + 1,
    )


def test_dcp_multiplies_concurrency_of_an_mla_model() -> None:
    spec, h200 = load("deepseek_v3"), device_by_name("h200")
    plain = memory_plan(spec, h200, EngineShape(tp=8))
    sharded = memory_plan(spec, h200, EngineShape(tp=8, dcp=8))
    assert plain.weight_bytes == sharded.weight_bytes  # DCP adds no GPUs and moves no weights
    context = 131_072
    assert plain.max_concurrent_sequences(context) >= 1
    ratio = sharded.max_concurrent_sequences(context) / plain.max_concurrent_sequences(context)
    assert 7.5 <= ratio <= 8.5


def test_what_does_not_fit_holds_nothing() -> None:
    # Kimi K2 in FP8 (~1.03 TB) on 8 x H200 (1,128 GB): Moonshot's deployment guide puts the
    # smallest H200 unit at 16 GPUs.
    spec, h200 = load("kimi_k2"), device_by_name("h200")
    plan = memory_plan(spec, h200, EngineShape(tp=8))
    assert not plan.fits
    assert plan.max_concurrent_sequences(1) == 0 and plan.max_context_tokens() == 0
    report = fits_on(spec, [h200])
    assert report.smallest_single is None
    assert report.num_largest == 16


def test_fits_on_picks_the_smallest_device_or_counts_the_largest() -> None:
    llama = load("llama3_8b")
    report = fits_on(llama, DEVICES)
    assert report.smallest_single is not None
    assert report.smallest_single.name == "h100-sxm"  # the smallest memory in the catalog
    ds = load("deepseek_v3")
    hgx = [device_by_name("h100-sxm"), device_by_name("h200")]
    report = fits_on(ds, hgx)
    # 688 GB of FP8 weights: 8 x H200 (1,128 GB) holds them; 8 x H100 (640 GB) does not.
    assert report.smallest_single is None
    assert report.largest.name == "h200" and report.num_largest == 8
    by_device = {d.name: shape for d, shape in report.per_device}
    h100_shape = by_device["h100-sxm"]
    assert h100_shape is not None and h100_shape.num_gpus == 16


def test_engine_shapes_the_engine_would_reject() -> None:
    ds = load("deepseek_v3")
    h200 = device_by_name("h200")
    with pytest.raises(InvalidEngineShape, match="tp=3"):
        memory_plan(ds, h200, EngineShape(tp=3))
    with pytest.raises(InvalidEngineShape, match="dcp=3 must divide tp=8"):
        EngineShape(tp=8, dcp=3)
    llama = load("llama3_8b")
    with pytest.raises(InvalidEngineShape, match=r"dcp=2 is not valid .* only dcp=1"):
        memory_plan(llama, h200, EngineShape(tp=8, dcp=2))
    with pytest.raises(UnknownDevice, match="'tpu-v9'"):
        device_by_name("tpu-v9")


def test_every_catalog_figure_names_its_source() -> None:
    names = [d.name for d in DEVICES]
    assert len(names) == len(set(names))
    for device in DEVICES:
        assert device.source and device.memory_bytes > 0 and device.memory_bandwidth_gbps > 0
    assert device_by_name("gb300").nvlink_domain_size == 72
    assert device_by_name("h200").nvlink_domain_size == 8
    assert device_by_name("h200").memory_bytes == 141 * 10**9
