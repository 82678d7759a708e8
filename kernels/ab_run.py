"""Runs the two engines of an A/B (``kernels.ab``): vLLM's ``AsyncLLM``, one side at a time.

Each side starts an engine from ``kernels.ab.engine_args``, sends the batch sizes in
order (``batch`` concurrent greedy requests, streamed so every token's arrival is
timed, top-5 logprobs kept for the divergence margin), asks its workers what they built
(``BackendProbe``, vLLM's ``worker_extension_cls``: the engine's ``additional_config``,
the class of every module of the model and the attention backend of every attention
layer, for ``kernels.ab.backend_proof``), and shuts
the engine down before the other side starts: the sides never share a GPU. Needs vLLM
(``engines._vllm``) and its GPUs; nothing here runs in the CPU tests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kernels.ab import RequestRecord

__all__ = ["PROBE", "BackendProbe", "SideRun", "run_side"]

TOP_LOGPROBS = 5
PROBE = "kernels.ab_run.BackendProbe"


class BackendProbe:
    """Mixed into each vLLM worker (``worker_extension_cls``): what the worker built."""

    def kvtide_backend_report(self) -> dict[str, Any]:
        worker: Any = self
        model = worker.model_runner.get_model()
        built = set()
        for m in model.modules():
            built.add(f"{type(m).__module__}.{type(m).__qualname__}")
            backend = getattr(m, "get_attn_backend", None)
            if callable(backend):  # a path may swap the kernels inside the same modules
                cls = backend()
                built.add(f"attention backend {getattr(cls, '__module__', '')}.{cls.__qualname__}")
        config = getattr(worker.vllm_config, "additional_config", None) or {}
        return {"additional_config": dict(config), "modules": sorted(built)}


@dataclass(frozen=True, slots=True, kw_only=True)
class SideRun:
    """One side: ``{batch: one record per request}`` and worker 0's backend report."""

    records: dict[int, list[RequestRecord]]
    backend: dict[str, Any]


async def _one(engine: Any, sampling: Any, prompt: str, request_id: str) -> RequestRecord:
    tokens: list[int] = []
    arrivals: list[float] = []
    tops: list[dict[int, float]] = []
    start = time.perf_counter()
    async for out in engine.generate(prompt, sampling, request_id):
        now = time.perf_counter() - start
        completion = out.outputs[0]
        tokens += list(completion.token_ids)
        arrivals += [now] * len(completion.token_ids)
        for position in completion.logprobs or []:
            tops.append({int(t): float(lp.logprob) for t, lp in position.items()})
    return RequestRecord(
        token_ids=tuple(tokens), arrival_s=tuple(arrivals), top_logprobs=tuple(tops)
    )


async def _side(
    args: Mapping[str, Any], prompts: Sequence[str], batches: Sequence[int], max_tokens: int
) -> SideRun:
    from engines._vllm import require_vllm

    vllm = require_vllm()
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(vllm.AsyncEngineArgs(**args, worker_extension_cls=PROBE))
    sampling = vllm.SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=TOP_LOGPROBS,
        output_kind=RequestOutputKind.DELTA,
    )
    out: dict[int, list[RequestRecord]] = {}
    try:
        await _one(engine, sampling, prompts[0], "warm-up")  # graphs, compile, allocator
        reports = await engine.collective_rpc("kvtide_backend_report", timeout=60)
        for batch in batches:
            calls = [_one(engine, sampling, prompts[i], f"b{batch}-{i}") for i in range(batch)]
            out[batch] = list(await asyncio.gather(*calls))
    finally:
        engine.shutdown()
    return SideRun(records=out, backend=dict(reports[0]))


def run_side(
    args: Mapping[str, Any], prompts: Sequence[str], batches: Sequence[int], max_tokens: int
) -> SideRun:
    """Every batch size through one engine, and what its workers built."""
    return asyncio.run(_side(args, prompts, batches, max_tokens))
