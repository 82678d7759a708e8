"""A decode engine's warm-up turn (``orchestrator.serve.warm_up``) between two simulated
engines that hand KV over as vLLM's NixlConnector does (same fabric, virtual clock)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

import pytest
from simulated_specs import llama_spec

from engines.base import EngineInfo, GenerateChunk, GenerateRequest, KVTransferSpec
from engines.kv_params import KVTransferParams
from engines.simulated import RequestRejected, SimulatedEngine, VirtualClock
from engines.simulated_kv import SimulatedFabric
from orchestrator.serve.warm_up import (
    WarmUp,
    measure_prefill,
    warm_up_prompt_tokens,
    warm_up_transfers,
)
from placement.model_catalog import load_model_spec

# The embedded tiny model's vocabulary size: a warm-up prompt must stay inside it (vLLM,
# like the simulated engine, rejects a request with an id past it).
VOCAB = 2048


def _engine(
    engine_id: str, role: str, clock: VirtualClock, fabric: SimulatedFabric
) -> SimulatedEngine:
    spec = llama_spec(engine_id, role, kv=KVTransferSpec(decoder_kv_blocks_ttl_s=480))
    model = dataclasses.replace(load_model_spec(spec.model_path), vocab_size=VOCAB)
    return SimulatedEngine(spec, model=model, sleep=clock.sleep, clock=clock.time, fabric=fabric)


class FlakyPrefill:
    """The prefill engine, whose first ``fail_reads`` read-backs fail as a NIXL
    handshake that timed out does (the engine ends the request with an error)."""

    def __init__(self, engine: SimulatedEngine, fail_reads: int = 0) -> None:
        self.engine = engine
        self.fail_reads = fail_reads
        self.request_ids: list[str] = []

    async def _failed(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        yield GenerateChunk(request_id=request.request_id, finished=True, finish_reason="error")

    def __call__(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self.request_ids.append(request.request_id)
        params = request.kv_transfer_params
        if params is not None and params.remote_block_ids and self.fail_reads > 0:
            self.fail_reads -= 1
            return self._failed(request)
        return self.engine.generate(request)


async def _started_pair() -> tuple[VirtualClock, SimulatedEngine, SimulatedEngine, EngineInfo]:
    """A started prefill and decode engine on one virtual clock and fabric, and the
    decode engine's info."""
    clock, fabric = VirtualClock(), SimulatedFabric()
    prefill_engine = _engine("p0", "prefill", clock, fabric)
    decode = _engine("d0", "decode", clock, fabric)
    await prefill_engine.start()
    return clock, prefill_engine, decode, await decode.start()


def warm_up(
    fail_reads: int, attempts: int = 3, prompt_logprobs: bool = False
) -> tuple[WarmUp, FlakyPrefill, SimulatedEngine]:
    async def story() -> tuple[WarmUp, FlakyPrefill, SimulatedEngine]:
        clock, prefill_engine, decode, info = await _started_pair()
        prefill = FlakyPrefill(prefill_engine, fail_reads)
        result = await warm_up_transfers(
            decode.generate,
            prefill,
            name="d0-0",
            num_prompt_tokens=warm_up_prompt_tokens(16, 64),
            vocab_size=info.vocab_size,
            step_timeout_s=30,
            attempts=attempts,
            clock=clock.time,
            prompt_logprobs=prompt_logprobs,
        )
        return result, prefill, decode

    return asyncio.run(story())


def test_the_warm_up_turn_is_sent_back_and_leaves_no_blocks_on_decode() -> None:
    result, prefill, decode = warm_up(fail_reads=0)
    assert (result.sent_back, result.attempts, result.error) == (True, 1, None)
    # Prefill, then its read-back of what decode kept; the decode engine freed them.
    assert prefill.request_ids == ["warmup-d0-0-1-p", "warmup-d0-0-1-r"]
    assert decode.stats().num_kv_transfers == 1  # the decode pulled the prefill's KV
    assert decode.stats().kv_cache_usage == 0
    # Nobody decodes after the read-back: the prefill engine keeps no copy leased either.
    assert prefill.engine.stats().kv_cache_usage == 0


def test_with_the_integrity_check_on_the_prefills_prompt_logprobs_are_warmed_first() -> None:
    result, prefill, decode = warm_up(fail_reads=0, prompt_logprobs=True)
    assert (result.sent_back, result.attempts) == (True, 1)
    assert prefill.request_ids == ["warmup-d0-0-i", "warmup-d0-0-1-p", "warmup-d0-0-1-r"]
    # Sessionless, nothing kept or read: the engines hold nothing after the warm-up.
    assert prefill.engine.stats().kv_cache_usage == 0
    assert decode.stats().kv_cache_usage == 0


def test_a_failed_read_back_is_tried_again_on_the_same_blocks() -> None:
    result, prefill, decode = warm_up(fail_reads=1)
    assert (result.sent_back, result.attempts) == (True, 2)
    assert prefill.request_ids == ["warmup-d0-0-1-p", "warmup-d0-0-1-r", "warmup-d0-0-2-r"]
    assert decode.stats().kv_cache_usage == 0  # read on the second try, so freed


def test_the_warm_up_prompt_is_read_not_recomputed() -> None:
    # Past vLLM's recompute threshold by two blocks, so both transfers are reads.
    assert warm_up_prompt_tokens(16, 64) == 96
    assert warm_up_prompt_tokens(16, 0) == 64


def test_a_warm_up_that_never_succeeds_says_so_and_does_not_raise() -> None:
    result, prefill, _ = warm_up(fail_reads=5, attempts=2)
    assert not result.sent_back and result.attempts == 2
    assert result.error is not None and "KV load failed" in result.error
    assert prefill.request_ids == ["warmup-d0-0-1-p", "warmup-d0-0-1-r", "warmup-d0-0-2-r"]


def test_an_engine_rejects_a_prompt_outside_its_vocabulary() -> None:
    async def story() -> None:
        clock, fabric = VirtualClock(), SimulatedFabric()
        engine = _engine("p0", "prefill", clock, fabric)
        assert (await engine.start()).vocab_size == VOCAB
        request = GenerateRequest(request_id="r", prompt_token_ids=[1, VOCAB], max_tokens=1)
        with pytest.raises(RequestRejected, match=f"Token id {VOCAB} is out of vocabulary"):
            async for _ in engine.generate(request):
                pass

    asyncio.run(story())


class TimedDecode:
    """A decode engine whose request takes 30 ms, plus ``per_token_s`` per prompt token,
    on ``clock``; a request of ``fail_at`` tokens fails."""

    def __init__(self, per_token_s: float, fail_at: int | None = None) -> None:
        self.now_s = 0.0
        self.per_token_s = per_token_s
        self.fail_at = fail_at
        self.requests: list[GenerateRequest] = []

    def clock(self) -> float:
        return self.now_s

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self.requests.append(req)
        n = len(req.prompt_token_ids)
        if n == self.fail_at:
            raise RuntimeError("engine gone")
        self.now_s += 0.03 + n * self.per_token_s
        yield GenerateChunk(request_id=req.request_id, token_ids=[1], finished=True)


def measured(decode: TimedDecode) -> float | None:
    return asyncio.run(
        measure_prefill(
            decode.generate,
            name="decode-r1",
            num_prompt_tokens=512,
            vocab_size=1000,
            timeout_s=5.0,
            clock=decode.clock,
        )
    )


def test_a_decode_engine_measures_its_prefill_time_per_token() -> None:
    decode = TimedDecode(per_token_s=0.0014)
    # The per-request cost cancels: the difference of a 512- and a 128-token prefill.
    assert measured(decode) == pytest.approx(0.0014)
    short, long = decode.requests
    assert (len(short.prompt_token_ids), len(long.prompt_token_ids)) == (128, 512)
    # Computed from scratch and kept nowhere: distinct prompts, nothing kept.
    assert short.prompt_token_ids != long.prompt_token_ids[:128]
    assert all(500 <= t < 1000 for t in long.prompt_token_ids)
    assert all(r.kv_transfer_params == KVTransferParams(kvtide_keep=False) for r in decode.requests)


def test_a_measurement_that_fails_reports_nothing() -> None:
    assert measured(TimedDecode(per_token_s=0.0014, fail_at=512)) is None
    assert measured(TimedDecode(per_token_s=0.0)) is None  # the longer was not slower


def test_a_read_back_that_hangs_is_given_up_at_its_step_deadline_each_try() -> None:
    class HungReads(FlakyPrefill):
        async def _hung(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
            await asyncio.Event().wait()  # the read of decode's blocks never completes
            yield GenerateChunk(request_id=request.request_id)

        def __call__(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
            params = request.kv_transfer_params
            if params is not None and params.remote_block_ids:
                self.request_ids.append(request.request_id)
                return self._hung(request)
            return self.engine.generate(request)

    async def story() -> tuple[WarmUp, float, list[str]]:
        clock, prefill_engine, decode, info = await _started_pair()
        prefill = HungReads(prefill_engine)
        t0 = time.monotonic()
        result = await warm_up_transfers(
            decode.generate,
            prefill,
            name="d0-0",
            num_prompt_tokens=warm_up_prompt_tokens(16, 64),
            vocab_size=info.vocab_size,
            step_timeout_s=0.2,
            clock=clock.time,
        )
        return result, time.monotonic() - t0, prefill.request_ids

    result, took_s, reads = asyncio.run(story())
    # 3 tries, each given up after 0.2 s; the engine then serves anyway.
    assert not result.sent_back and result.attempts == 3
    assert reads == ["warmup-d0-0-1-r", "warmup-d0-0-2-r", "warmup-d0-0-3-r"]
    assert took_s < 3 * 0.2 + 2.0
