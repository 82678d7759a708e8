"""Sampling a client asks for reaches the engine: request → router → vLLM's
SamplingParams, on prefill and decode alike (issue 12: never silently ignored)."""

from __future__ import annotations

import asyncio

import msgspec
from simulated_specs import llama_spec
from test_router import FakePool, decode_script, make_router, prefill_script

from engines.base import GenerateRequest, Sampling
from engines.simulated import SimulatedEngine, VirtualClock
from engines.vllm_engine import sampling_args_for
from orchestrator.router import Turn
from orchestrator.serve import openai_api as api

OPTIONS = {
    "presence_penalty": 0.5,
    "frequency_penalty": -0.25,
    "repetition_penalty": 1.1,
    "top_k": 40,
    "min_p": 0.05,
    "min_tokens": 3,
}


def test_the_router_gives_prefill_and_decode_the_clients_sampling() -> None:
    prefill, decode = FakePool(prefill_script()), FakePool(decode_script)
    router = make_router(prefill, decode)
    req = api.parse_chat(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **OPTIONS}, "m"
    )

    async def run() -> None:
        sampling = msgspec.structs.replace(req.sampling, seed=11)
        turn = router.run_turn(
            Turn(prompt_token_ids=list(range(40)), max_tokens=3, sampling=sampling)
        )
        async for _ in turn:
            pass

    asyncio.run(run())
    [pre] = [r for r in prefill.requests if not r.request_id.startswith("drain-")]
    [dec] = decode.requests
    for sent in (pre, dec):
        assert {k: getattr(sent.sampling, k) for k in OPTIONS} == OPTIONS
        assert sent.sampling.seed == 11


def test_vllm_gets_every_sampling_field_and_min_tokens_within_max_tokens() -> None:
    request = GenerateRequest(
        request_id="r",
        prompt_token_ids=[1, 2],
        max_tokens=8,
        sampling=Sampling(seed=5, stop=("x",), **OPTIONS),
    )
    args = sampling_args_for(request)
    assert {k: args[k] for k in OPTIONS} == OPTIONS
    assert (args["max_tokens"], args["seed"], args["stop"]) == (8, 5, ["x"])
    # A turn's prefill runs one token with the turn's sampling: vLLM refuses
    # min_tokens > max_tokens, so the engine caps it.
    prefill = GenerateRequest(
        request_id="p", prompt_token_ids=[1], max_tokens=1, sampling=Sampling(min_tokens=3)
    )
    assert sampling_args_for(prefill)["min_tokens"] == 1
    defaults = sampling_args_for(
        GenerateRequest(request_id="d", prompt_token_ids=[1], max_tokens=2)
    )
    assert defaults["top_k"] == 0 and defaults["repetition_penalty"] == 1.0
    assert defaults["extra_args"] is None


def test_the_simulated_engine_accepts_them() -> None:
    spec = llama_spec("s")
    clock = VirtualClock()

    async def run() -> list[int]:
        engine = SimulatedEngine(spec, sleep=clock.sleep, clock=clock.time)
        await engine.start()
        request = GenerateRequest(
            request_id="r",
            prompt_token_ids=list(range(20)),
            max_tokens=4,
            sampling=Sampling(**OPTIONS),
        )
        out = [t async for c in engine.generate(request) for t in c.token_ids]
        await engine.shutdown()
        return out

    assert len(asyncio.run(run())) == 4
