"""The engine the unit tests simulate: Llama-3-8B (bf16) on CUDA, in 16-token blocks.

``engines.simulated.SimulatedEngine`` prices it with the capacity model; one spec here
keeps every test that runs it describing the same engine.
"""

from __future__ import annotations

from typing import Any

from engines.base import EngineSpec, KVTransferSpec

BLOCK_SIZE = 16


def llama_spec(
    engine_id: str,
    role: str = "both",
    *,
    blocks: int | None = 64,
    kv: KVTransferSpec | None = None,
    **extra: Any,
) -> EngineSpec:
    """A simulated Llama-3-8B engine with ``blocks`` KV blocks (None: as many as the
    memory model leaves); ``extra`` goes to its ``extra_engine_args``."""
    args: dict[str, Any] = dict(extra)
    if blocks is not None:
        args["num_gpu_blocks_override"] = blocks
    return EngineSpec(
        engine_id=engine_id,
        role=role,  # type: ignore[arg-type]
        model_path="llama3-8b",
        served_model_name="llama",
        backend="simulated",
        device="cuda",
        dtype="bfloat16",
        block_size=BLOCK_SIZE,
        max_model_len=8192,
        kv_transfer=kv,
        extra_engine_args=tuple(args.items()),
    )
