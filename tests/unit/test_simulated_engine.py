"""The simulated engine on a virtual clock: P/D hand-off, send-back, KV accounting, scale.

Engines here simulate Llama-3-8B (bf16, 131,072 B of KV per token at TP1) on an H200
with 16-token blocks, and 64 blocks unless a test says otherwise, so block ids are
small enough to name. Nothing sleeps: time moves only when an engine steps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import pytest
from simulated_specs import llama_spec

from engines.base import EngineSpec, GenerateChunk, GenerateRequest, KVTransferSpec
from engines.kv_params import KVTransferParams
from engines.registry import create_engine
from engines.simulated import KVTransferFailed, RequestRejected, SimulatedEngine, VirtualClock
from engines.simulated_kv import SimulatedFabric
from placement.capacity import EngineShape, memory_plan
from placement.decode_model import decode_step
from placement.devices import device_by_name
from placement.model_catalog import builtin_model_spec

LLAMA_KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # 131,072
PREFILL_TOKENS_PER_S = 10_000.0


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


def spec(engine_id: str, role: str = "both", **options: Any) -> EngineSpec:
    """``llama_spec`` of an engine that prefills PREFILL_TOKENS_PER_S tokens a second."""
    return llama_spec(engine_id, role, prefill_tokens_per_s=PREFILL_TOKENS_PER_S, **options)


class Pair:
    """A prefill and a decode engine with send-back, on one fabric and one clock."""

    def __init__(self, **kv_options: Any) -> None:
        self.clock = VirtualClock()
        self.fabric = SimulatedFabric()
        kv = KVTransferSpec(decoder_kv_blocks_ttl_s=480, **kv_options)
        self.prefill = self.engine(spec("p0", "prefill", kv=kv))
        self.decode = self.engine(spec("d0", "decode", kv=kv))

    def engine(self, engine_spec: EngineSpec) -> SimulatedEngine:
        return SimulatedEngine(
            engine_spec, sleep=self.clock.sleep, clock=self.clock.time, fabric=self.fabric
        )

    async def __aenter__(self) -> Pair:
        await self.prefill.start()
        await self.decode.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.prefill.shutdown()
        await self.decode.shutdown()


async def collect(engine: SimulatedEngine, request: GenerateRequest) -> list[GenerateChunk]:
    return [chunk async for chunk in engine.generate(request)]


def req(
    request_id: str, prompt: list[int], max_tokens: int, params: KVTransferParams | None = None
) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        max_tokens=max_tokens,
        kv_transfer_params=params,
    )


def tokens(chunks: list[GenerateChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


PROMPT = list(range(1000, 1200))  # 200 tokens = 13 blocks of 16 (the last one half full)
KEEP = KVTransferParams.keep_for_decode()  # a prefill: keep the prompt's KV for decode


def test_prefill_hands_its_blocks_to_decode_which_pulls_them_and_decodes_like_one_engine() -> None:
    async def story() -> None:
        async with Pair() as pair:
            p, d, clock = pair.prefill, pair.decode, pair.clock
            # Turn 1, prefill: 200 prompt tokens in 13 blocks, one token, blocks kept.
            out = await collect(p, req("t1-p", PROMPT, 1, KEEP))
            assert clock.now_s == pytest.approx(200 / PREFILL_TOKENS_PER_S)
            params = out[-1].kv_transfer_params
            assert params is not None
            assert params.do_remote_prefill is True and params.do_remote_decode is False
            assert params.remote_block_ids == (tuple(range(13)),)
            assert (params.remote_engine_id, params.remote_request_id) == ("p0", "t1-p")
            assert params.remote_num_tokens == 200
            assert p.stats().kv_cache_usage == 13 / 64  # kept for decode to read

            # Turn 1, decode: pulls 200 tokens' KV, recomputes the last, decodes 8.
            out_d = await collect(d, req("t1-d", PROMPT, 8, params))
            assert out_d[-1].num_cached_tokens == 199
            assert p.stats().kv_cache_usage == 0  # the read freed prefill's copy
            stats = d.stats()
            assert stats.num_kv_transfers == 1
            assert stats.kv_transfer_bytes == 200 * LLAMA_KV_BYTES_PER_TOKEN
            # The request's own read, on its first chunk only; the prefill read nothing.
            assert [c.kv_read_bytes for c in out_d] == [200 * LLAMA_KV_BYTES_PER_TOKEN] + [None] * (
                len(out_d) - 1
            )
            assert out[-1].kv_read_bytes == 0
            # The first token is the one prefill sampled, and the whole output is what a
            # single engine produces for the prompt.
            assert out_d[0].token_ids == out[-1].token_ids
            plain = pair.engine(spec("solo"))
            await plain.start()
            assert tokens(out_d) == tokens(await collect(plain, req("solo", PROMPT, 8)))
            await plain.shutdown()

    run(story())


def test_decode_keeps_its_blocks_and_the_next_prefill_pulls_them_back() -> None:
    async def story() -> None:
        async with Pair() as pair:
            p, d, clock = pair.prefill, pair.decode, pair.clock
            out = await collect(p, req("t1-p", PROMPT, 1, KEEP))
            out_d = await collect(d, req("t1-d", PROMPT, 8, out[-1].kv_transfer_params))
            # Decode keeps prompt + 7 computed output tokens = 207 tokens in 13 blocks.
            back = out_d[-1].kv_transfer_params
            assert back is not None
            assert back.do_remote_decode is True and back.do_remote_prefill is False
            assert back.remote_num_tokens == 207
            assert back.remote_block_ids == (tuple(range(13)),)
            assert back.remote_blocks_expiry_time == pytest.approx(clock.now_s + 480)
            assert d.stats().kv_cache_usage == 13 / 64

            # Turn 2: history plus 40 new tokens; prefill reads the 207 tokens back.
            turn2 = PROMPT + tokens(out_d) + list(range(40))
            params = back.pull_back(keep=True)
            out2 = await collect(p, req("t2-p", turn2, 1, params))
            assert out2[-1].num_cached_tokens == 207
            assert p.stats().num_kv_transfers == 1
            # The read back, on the prefill's one (finished) chunk.
            assert out2[-1].kv_read_bytes == 207 * LLAMA_KV_BYTES_PER_TOKEN
            assert d.stats().kv_cache_usage == 0  # read back, so decode freed them
            # And prefill hands turn 2 on as in turn 1: 255 tokens in 16 blocks.
            assert out2[-1].kv_transfer_params is not None
            # (freed blocks join the back of the free queue, as in vLLM: 13 is next)
            assert out2[-1].kv_transfer_params.remote_block_ids == (tuple(range(13, 29)),)

    run(story())


def test_decode_keeps_blocks_only_when_asked_and_a_drain_frees_the_prefill_copy() -> None:
    async def story() -> None:
        async with Pair() as pair:
            p, d = pair.prefill, pair.decode
            # A sessionless request: its decode is asked not to keep. It frees its 13
            # blocks when it finishes and offers nothing back.
            pre = (await collect(p, req("a-p", PROMPT, 1, KEEP)))[-1].kv_transfer_params
            assert pre is not None
            out = await collect(d, req("a-d", PROMPT, 8, pre.for_decode(keep=False)))
            assert out[-1].kv_transfer_params is None
            assert d.stats().kv_cache_usage == 0 and p.stats().kv_cache_usage == 0

            # A session's turn: its decode keeps them for the next turn's prefill.
            pre = (await collect(p, req("b-p", PROMPT, 1, KEEP))).pop().kv_transfer_params
            assert pre is not None
            out = await collect(d, req("b-d", PROMPT, 8, pre.for_decode(keep=True)))
            back = out[-1].kv_transfer_params
            assert back is not None and back.kept_blocks() is not None
            assert d.stats().kv_cache_usage == 13 / 64

            # A drain reads them back and keeps no copy on prefill: both engines are
            # empty once it finishes (no lease left to run out).
            drain = PROMPT + tokens(out)[:7] + [1]
            read = await collect(p, req("drain", drain, 1, back.pull_back(keep=False)))
            assert read[-1].num_cached_tokens == 207
            assert read[-1].kv_transfer_params is None
            assert d.stats().kv_cache_usage == 0 and p.stats().kv_cache_usage == 0
            # Requests each engine ran: two prefills and the drain; two decodes.
            assert (p.stats().num_requests, d.stats().num_requests) == (3, 2)

    run(story())


def test_a_prefills_blocks_nobody_reads_are_kept_for_the_prefill_lease() -> None:
    """vLLM's ``kv_lease_duration`` (``kv.prefill_lease_s``), not the decode TTL."""

    async def story() -> None:
        async with Pair(prefill_lease_s=90) as pair:
            p = pair.prefill
            assert (await collect(p, req("a-p", PROMPT, 1, KEEP)))[-1].kv_transfer_params
            assert p.stats().kv_cache_usage == 13 / 64  # kept for the decode's read
            pair.clock.advance(89.0)
            assert p.stats().kv_cache_usage == 13 / 64
            pair.clock.advance(2.0)  # the lease ran out, nobody read them: free
            assert p.stats().kv_cache_usage == 0

    run(story())


def test_without_kvtide_connector_decode_keeps_every_finished_request() -> None:
    async def story() -> None:
        async with Pair(per_request_keep=False) as pair:  # vLLM's own NixlConnector
            p, d = pair.prefill, pair.decode
            pre = (await collect(p, req("a-p", PROMPT, 1, KEEP)))[-1].kv_transfer_params
            assert pre is not None
            out = await collect(d, req("a-d", PROMPT, 8, pre.for_decode(keep=False)))
            assert out[-1].kv_transfer_params is not None  # the flag is not read
            assert d.stats().kv_cache_usage == 13 / 64

    run(story())


def test_send_back_is_skipped_near_expiry_and_under_the_recompute_threshold() -> None:
    async def story() -> None:
        async with Pair() as pair:
            p, d, clock = pair.prefill, pair.decode, pair.clock
            out = await collect(p, req("a-p", PROMPT, 1, KEEP))
            back = (await collect(d, req("a-d", PROMPT, 8, out[-1].kv_transfer_params)))[-1]
            assert back.kv_transfer_params is not None
            params = back.kv_transfer_params.pull_back(keep=True)
            # 476 s later the blocks expire in 4 s: prefill declines and recomputes.
            clock.advance(476)
            out2 = await collect(p, req("a-2", PROMPT + list(range(10)), 1, params))
            # Nothing pulled: only turn 1's prompt, still in the prefix cache (12 blocks).
            assert out2[-1].num_cached_tokens == 192 and p.stats().num_kv_transfers == 0
            assert p.stats().num_kv_expired_reads == 1
            assert d.stats().kv_cache_usage == 13 / 64  # still kept, until the TTL
            clock.advance(10)
            assert d.stats().kv_cache_usage == 0  # past the TTL the blocks count as free

            # 40 tokens of history is under the 64-token threshold: recompute silently.
            short = list(range(33))
            out = await collect(p, req("b-p", short, 1, KEEP))
            back = (await collect(d, req("b-d", short, 8, out[-1].kv_transfer_params)))[-1]
            assert back.kv_transfer_params is not None
            assert back.kv_transfer_params.remote_num_tokens == 40
            params = back.kv_transfer_params.pull_back(keep=True)
            out2 = await collect(p, req("b-2", short + list(range(50)), 1, params))
            # Nothing pulled: the prefix cache holds the history's 2 full blocks.
            assert out2[-1].num_cached_tokens == 32
            assert p.stats().num_kv_transfers == 0
            assert p.stats().num_kv_expired_reads == 1  # unchanged: not a decline

    run(story())


def test_a_pull_of_blocks_already_read_fails_or_recomputes_by_policy() -> None:
    async def story(policy: str) -> tuple[list[GenerateChunk] | Exception, float]:
        async with Pair(kv_load_failure_policy=policy) as pair:
            p, d = pair.prefill, pair.decode
            out = await collect(p, req("p", PROMPT, 1, KEEP))
            params = out[-1].kv_transfer_params
            await collect(d, req("d1", PROMPT, 2, params))
            try:
                result = await collect(d, req("d2", PROMPT, 2, params))  # read already
            except KVTransferFailed as exc:
                result = exc
            assert d.stats().num_kv_transfer_failures == 1
            return result, d.stats().kv_cache_usage

    failed, usage = run(story("fail"))
    assert isinstance(failed, KVTransferFailed)
    assert "'p0' no longer holds the KV of 'p'" in str(failed)
    assert usage == 13 / 64  # d1's blocks, kept for send-back; d2 kept nothing
    recomputed, usage = run(story("recompute"))
    # Nothing pulled: d1's prompt (12 full blocks) is in decode's own prefix cache.
    assert isinstance(recomputed, list) and recomputed[-1].num_cached_tokens == 192
    assert usage == 26 / 64  # d2 computed the prompt itself and keeps it too


def test_admission_reserves_the_worst_case_and_blocks_come_back_when_requests_end() -> None:
    async def story() -> None:
        clock = VirtualClock()
        engine = SimulatedEngine(
            spec("e", blocks=20), sleep=clock.sleep, clock=clock.time, fabric=SimulatedFabric()
        )
        await engine.start()
        # Each request: 100 prompt + 60 output tokens, worst case ceil(159 / 16) = 10
        # blocks, so 2 of the 3 fit in 20 blocks and the third waits.
        prompts = [[i] * 100 for i in range(3)]
        streams = [engine.generate(req(f"r{i}", prompts[i], 60)) for i in range(3)]
        firsts = [asyncio.ensure_future(anext(s)) for s in streams]
        await asyncio.gather(*firsts[:2])  # the first step: r0 and r1 prefilled
        stats = engine.stats()
        assert (stats.num_running, stats.num_waiting) == (2, 1)
        assert stats.kv_cache_usage == 14 / 20  # 7 blocks of prompt each so far
        # r2 runs once r0 and r1 give their blocks back.
        outs = await asyncio.gather(*(rest_of(f, s) for f, s in zip(firsts, streams, strict=True)))
        assert [len(o) for o in outs] == [60, 60, 60]
        stats = engine.stats()
        assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
        assert stats.num_prompt_tokens == 300 and stats.num_generation_tokens == 180
        await engine.shutdown()

    run(story())


async def rest_of(first: asyncio.Future[GenerateChunk], stream: Any) -> list[GenerateChunk]:
    return [await first, *[chunk async for chunk in stream]]


def test_abort_frees_the_blocks_and_ends_the_stream() -> None:
    async def story() -> None:
        clock = VirtualClock()
        engine = SimulatedEngine(
            spec("e"), sleep=clock.sleep, clock=clock.time, fabric=SimulatedFabric()
        )
        await engine.start()
        stream = engine.generate(req("r", PROMPT, 100))
        await anext(stream)
        assert engine.stats().kv_cache_usage == 13 / 64
        await engine.abort("r")
        last = [c async for c in stream][-1]
        assert (last.finished, last.finish_reason, last.kv_transfer_params) == (
            True,
            "abort",
            None,
        )
        assert engine.stats().kv_cache_usage == 0
        await engine.shutdown()

    run(story())


def test_step_times_come_from_the_decode_model() -> None:
    async def story() -> float:
        clock = VirtualClock()
        engine = SimulatedEngine(
            spec("e"), sleep=clock.sleep, clock=clock.time, fabric=SimulatedFabric()
        )
        await engine.start()
        await collect(engine, req("r", PROMPT, 3))
        await engine.shutdown()
        return clock.now_s

    llama, h200 = builtin_model_spec("llama3-8b"), device_by_name("h200")
    steps = [
        decode_step(llama, h200, EngineShape(), batch_size=1, context_tokens=n).step_s
        for n in (200, 201)  # KV of the prompt, then of the prompt and the first token
    ]
    assert run(story()) == pytest.approx(200 / PREFILL_TOKENS_PER_S + sum(steps))


def test_blocks_come_from_the_memory_model_without_an_override() -> None:
    engine = SimulatedEngine(spec("e", blocks=None, simulated_device="h200"))
    plan = memory_plan(builtin_model_spec("llama3-8b"), device_by_name("h200"), EngineShape())
    assert engine.config.num_kv_blocks == plan.kv_budget_bytes // (16 * LLAMA_KV_BYTES_PER_TOKEN)
    kimi_on_8_h200 = EngineSpec(
        engine_id="k",
        role="decode",
        model_path="kimi-k2",
        served_model_name="kimi",
        device="cuda",
        dtype="auto",
        tensor_parallel_size=8,
    )
    with pytest.raises(ValueError, match="leaves no KV cache on h200 with tp=8"):
        SimulatedEngine(kimi_on_8_h200)
    with pytest.raises(ValueError, match="unknown extra_engine_args"):
        SimulatedEngine(spec("e", gpu_memory_utilisation=0.5))


def test_requests_it_can_never_run_are_rejected_naming_why() -> None:
    async def story() -> None:
        clock = VirtualClock()
        engine = SimulatedEngine(
            spec("e", blocks=4), sleep=clock.sleep, clock=clock.time, fabric=SimulatedFabric()
        )
        await engine.start()
        with pytest.raises(RequestRejected, match=r"needs 201 tokens \(13 blocks\).* and 4 blocks"):
            await collect(engine, req("r", PROMPT, 1))
        running = engine.generate(req("r", [1, 2, 3], 5))
        await anext(running)
        with pytest.raises(RequestRejected, match="'r' is already running"):
            await collect(engine, req("r", [4], 1))
        await running.aclose()  # a reader that stops early aborts its request
        assert engine.stats().kv_cache_usage == 0
        await engine.shutdown()

    run(story())


def test_the_registry_creates_it_by_name() -> None:
    engine = create_engine(spec("via-registry"))
    assert isinstance(engine, SimulatedEngine)


def test_200_engines_start_and_serve_quickly() -> None:
    """200 DeepSeek-V3 decode engines (H200, TP8 + DCP8), one request each."""

    async def story() -> list[list[int]]:
        engines = [
            SimulatedEngine(
                EngineSpec(
                    engine_id=f"d{i}",
                    role="decode",
                    model_path="deepseek-v3",
                    served_model_name="ds",
                    backend="simulated",
                    device="cuda",
                    dtype="auto",
                    tensor_parallel_size=8,
                    max_model_len=131072,
                    extra_engine_args=(("decode_context_parallel_size", 8),),
                ),
                sleep=(clock := VirtualClock()).sleep,
                clock=clock.time,
                fabric=SimulatedFabric(),
            )
            for i in range(200)
        ]
        await asyncio.gather(*(e.start() for e in engines))
        outs = await asyncio.gather(
            *(collect(e, req(f"r{i}", [i] * 4096, 32)) for i, e in enumerate(engines))
        )
        assert all(e.stats().num_generation_tokens == 32 for e in engines)
        await asyncio.gather(*(e.shutdown() for e in engines))
        return [tokens(o) for o in outs]

    started = time.perf_counter()
    outputs = run(story())
    assert time.perf_counter() - started < 15.0  # ~3 s here; a regression is 10x
    assert [len(o) for o in outputs] == [32] * 200
    assert len({tuple(o) for o in outputs}) == 200  # different prompts, different tokens


def test_a_prompt_computed_here_before_is_served_from_the_prefix_cache() -> None:
    async def story() -> None:
        clock = VirtualClock()
        engine = SimulatedEngine(spec("e0"), sleep=clock.sleep, clock=clock.time)
        await engine.start()
        try:
            turn1 = list(range(200))  # 12 full blocks of 16, 8 tokens over
            first = await collect(engine, req("t1", turn1, 1, None))
            assert first[-1].num_cached_tokens == 0
            # Turn 2 extends turn 1: its 12 full blocks are cached, the rest computed.
            t0 = clock.time()
            second = await collect(engine, req("t2", [*turn1, *range(1000, 1100)], 1, None))
            assert second[-1].num_cached_tokens == 192
            assert clock.time() - t0 == pytest.approx(108 / PREFILL_TOKENS_PER_S)
            # Another history shares nothing.
            other = await collect(engine, req("o", list(range(5000, 5200)), 1, None))
            assert other[-1].num_cached_tokens == 0
            stats = engine.stats()
            assert stats.num_prefix_cache_queries == 200 + 300 + 200
            assert stats.num_prefix_cache_hits == 192
        finally:
            await engine.shutdown()

    run(story())


def test_a_decode_in_another_process_is_read_by_its_params_and_frees_when_told() -> None:
    # Engines in two processes (Serve replicas): two fabrics, one clock. The prefill
    # reads the decode's kept blocks back by their params (simulated_remote_reads); the
    # decode frees them when its host is told of the read (peers_read).
    async def story() -> None:
        clock = VirtualClock()
        kv = KVTransferSpec(decoder_kv_blocks_ttl_s=480)

        def engine(engine_spec: EngineSpec) -> SimulatedEngine:
            return SimulatedEngine(
                engine_spec, sleep=clock.sleep, clock=clock.time, fabric=SimulatedFabric()
            )

        p = engine(spec("p0", "prefill", kv=kv, simulated_remote_reads=True))
        d = engine(spec("d0", "decode", kv=kv, simulated_remote_reads=True))
        await p.start()
        await d.start()
        out_d = await collect(d, req("t1-d", PROMPT, 8, KVTransferParams.keep_for_decode()))
        back = out_d[-1].kv_transfer_params
        assert back is not None and d.stats().kv_cache_usage == 13 / 64
        turn2 = PROMPT + tokens(out_d) + list(range(40))
        out2 = await collect(p, req("t2-p", turn2, 1, back.pull_back(keep=False)))
        assert out2[-1].num_cached_tokens == 207 and p.stats().num_kv_transfers == 1
        assert d.stats().kv_cache_usage == 13 / 64  # not told yet: still kept
        await d.peers_read(["t1-d"])
        assert d.stats().kv_cache_usage == 0
        # Without the setting, a peer elsewhere cannot be read: the pull fails.
        q = engine(spec("p1", "prefill", kv=kv))
        await q.start()
        with pytest.raises(KVTransferFailed):
            await collect(q, req("t3-p", turn2, 1, back.pull_back(keep=False)))
        for e in (p, d, q):
            await e.shutdown()

    run(story())


def test_kept_blocks_whose_last_chunk_nobody_took_are_freed() -> None:
    # The caller gave up (a turn past its deadline) after the decode finished but before
    # it read the last chunk, whose params name the kept blocks: nobody can read them.
    async def story() -> None:
        async with Pair() as pair:
            d = pair.decode
            stream = d.generate(req("t1-d", PROMPT, 8, KVTransferParams.keep_for_decode()))
            await anext(stream)
            for _ in range(1000):  # the engine's loop runs its steps on the virtual clock
                if d.stats().num_running == 0:
                    break
                await asyncio.sleep(0)
            assert d.stats().num_running == 0 and d.stats().kv_cache_usage == 13 / 64
            await stream.aclose()
            assert d.stats().kv_cache_usage == 0

    run(story())


def test_a_request_waiting_for_kept_blocks_starts_when_a_peer_read_frees_them() -> None:
    # On the real clock: the decode's cache is full of blocks kept for 480 s; a request
    # waits for room, and starts as soon as a peer's read frees them, not at their TTL.
    async def story() -> None:
        kv = KVTransferSpec(decoder_kv_blocks_ttl_s=480)
        d = SimulatedEngine(spec("d0", "decode", kv=kv, blocks=20), fabric=SimulatedFabric())
        await d.start()
        keep = KVTransferParams.keep_for_decode()
        await collect(d, req("t1-d", PROMPT, 8, keep))  # keeps 13 of 20 blocks
        waiting = asyncio.ensure_future(collect(d, req("t2-d", PROMPT, 8, keep)))
        for _ in range(100):
            await asyncio.sleep(0)
        assert d.stats().num_waiting == 1 and not waiting.done()
        await d.peers_read(["t1-d"])
        out = await asyncio.wait_for(waiting, 10.0)
        assert out[-1].finished and out[-1].finish_reason == "length"
        await d.shutdown()

    run(story())


def test_a_release_frees_a_kept_requests_blocks_with_nothing_read() -> None:
    async def story() -> None:
        async with Pair() as pair:
            p, d = pair.prefill, pair.decode
            pre = (await collect(p, req("b-p", PROMPT, 1, KEEP))).pop().kv_transfer_params
            assert pre is not None
            await collect(d, req("b-d", PROMPT, 8, pre.for_decode(keep=True)))
            assert d.stats().kv_cache_usage == 13 / 64
            # A one-token request naming the kept request frees its blocks when it
            # finishes; it keeps nothing itself, and no engine read a byte.
            await collect(d, req("b-release", PROMPT[:1], 1, KVTransferParams.release("b-d")))
            assert d.stats().kv_cache_usage == 0
            assert d.stats().num_kv_transfers == 1  # the turn's own pull only

    run(story())
