"""Each pool's decode path: the engine shape ``kernels.gate`` needs, built from the config.

``decode_path_for(config, pool)`` is called where a pool becomes ``EngineSpec``s
(``KVTideConfig.engine_spec``). The gate is asked only for vLLM engines on CUDA whose
config names ``gpu_arch``; everything else runs the stock path, with the reason said.
The model's dimensions come from the checkpoint's ``config.json``; one that cannot be
read also gives the stock path (the engine reports why), never an error here. The vLLM
version is the one installed where the config is read (the plugin checks the engine's);
only paths the config's ``specialised_paths`` names can be turned on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engines.decode_path import DecodePath, choose_decode_path
from kernels.gate import EngineShape
from kernels.vllm_plugin import installed_vllm_version
from placement.model_catalog import load_model_spec
from placement.model_errors import UnsupportedModel
from placement.model_spec import ModelSpec

if TYPE_CHECKING:
    from orchestrator.config import KVTideConfig, PoolConfig

__all__ = ["GATE_DTYPES", "decode_path_for", "engine_shape_for", "model_engine_shape"]

GATE_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
"""``model.dtype`` as the kernels' scopes name it; ``auto`` stays ``auto`` (the checkpoint
decides, which the gate cannot know: its kernels refuse it, vLLM's Kimi K3 path does not
depend on it)."""


def engine_shape_for(config: KVTideConfig, pool: PoolConfig) -> EngineShape | str:
    """The gate's view of one engine of ``pool``, or why there is none."""
    if config.backend != "vllm":
        return f"{config.backend} engine: it runs no GPU kernels"
    if config.device != "cuda" or config.gpu_arch is None:
        why = f"device {config.device}" if config.device != "cuda" else "no gpu_arch in config"
        return f"{why}: the gate is asked only for CUDA engines whose gpu_arch is set"
    try:
        model = load_model_spec(config.model.resolved_path())
    except (UnsupportedModel, OSError, ValueError) as exc:
        return f"cannot read the model's config.json for the gate: {exc}"
    return model_engine_shape(
        model,
        gpu_arch=config.gpu_arch,
        dtype=GATE_DTYPES.get(config.model.dtype, config.model.dtype),
        tp=pool.tensor_parallel_size,
        dcp=pool.decode_context_parallel_size,
        max_batch=pool.max_num_seqs,
        vllm_version=installed_vllm_version(),
    )


def model_engine_shape(
    model: ModelSpec,
    *,
    gpu_arch: str,
    dtype: str,
    tp: int,
    dcp: int,
    max_batch: int,
    vllm_version: str | None = None,
) -> EngineShape:
    """The gate's view of an engine of ``model`` (also what ``kvtide plan`` asks about)."""
    return EngineShape(
        gpu_arch=gpu_arch,
        model_type=model.model_type,
        dtype=dtype,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        # The DCP ranks merge the attention output: MLA's latent (kv_lora_rank) or a head.
        attention_head_dim=model.mla.kv_lora_rank if model.mla is not None else model.head_dim,
        tp=tp,
        dcp=dcp,
        max_batch=max_batch,
        vllm_version=vllm_version,
    )


def decode_path_for(config: KVTideConfig, pool: PoolConfig) -> DecodePath:
    """The decode path every engine of ``pool`` runs, and why (pure but for reading the
    checkpoint's ``config.json`` when the gate is asked)."""
    shape = engine_shape_for(config, pool)
    if isinstance(shape, str):
        return DecodePath(reason=shape)
    return choose_decode_path(shape, opted_in=config.specialised_paths)
