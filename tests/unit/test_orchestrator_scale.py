"""The orchestrator at scale on simulated engines: a router and the KV lifecycle service
in front of 8 prefill and 64 decode engines (Llama-3-8B on H200, simulated by the
capacity model), 400 concurrent three-turn sessions.

No GPU and no Ray: the engines are ``engines.simulated.SimulatedEngine`` on one
simulated NIXL fabric, each on its own virtual clock; the pools pick engines round robin
(as Serve's router spreads requests). What it shows is kvtide's own logic at a scale the
CPU box cannot run with real engines: every turn completes, every later turn pulls its
KV back from whichever decode engine kept it, the service's books match what the
engines hold, and closing the sessions drains every kept block.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

from simulated_specs import BLOCK_SIZE, llama_spec

from engines.base import GenerateChunk, GenerateRequest, KVTransferSpec
from engines.simulated import SimulatedEngine, VirtualClock
from engines.simulated_kv import SimulatedFabric
from orchestrator.kv.decider import kv_lifecycle_config
from orchestrator.kv.service import KVService, ServiceSettings
from orchestrator.router import Router, RouterSettings, Turn, TurnReport

NUM_PREFILL, NUM_DECODE, NUM_SESSIONS = 8, 64, 400
KV_BYTES_PER_TOKEN = 131_072  # Llama-3-8B, bf16, TP1
BLOCK = BLOCK_SIZE


def engine(engine_id: str, role: str, fabric: SimulatedFabric) -> SimulatedEngine:
    clock = VirtualClock()
    kv = KVTransferSpec(decoder_kv_blocks_ttl_s=480, bidirectional_kv_xfer=True)
    spec = llama_spec(engine_id, role, blocks=4096, kv=kv)
    return SimulatedEngine(spec, sleep=clock.sleep, clock=clock.time, fabric=fabric)


class RoundRobinPool:
    """A pool of engines reached like a Serve deployment: each request to the next."""

    def __init__(self, engines: list[SimulatedEngine]) -> None:
        self.engines = engines
        self._next = itertools.cycle(engines)

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        return next(self._next).generate(request)


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        self.now_s += 0.0001
        return self.now_s


async def session(router: Router, sid: int) -> list[TurnReport]:
    prompt = [(sid * 7 + i) % 30_000 + 10 for i in range(300 + sid % 200)]
    reports = []
    for turn in range(3):
        output: list[int] = []
        last: TurnReport | None = None
        async for chunk, report in router.run_turn(
            Turn(prompt_token_ids=prompt, max_tokens=16, session_id=f"s{sid}")
        ):
            output.extend(chunk.token_ids)
            last = report
        assert last is not None
        await router.settled()
        reports.append(last)
        prompt = [*prompt, *output, *range(100 + turn, 140 + turn)]  # answer + a question
    return reports


def test_400_sessions_over_72_simulated_engines() -> None:
    async def story() -> tuple[list[list[TurnReport]], list[SimulatedEngine]]:
        fabric = SimulatedFabric()
        prefills = [engine(f"p{i}", "prefill", fabric) for i in range(NUM_PREFILL)]
        decodes = [engine(f"d{i}", "decode", fabric) for i in range(NUM_DECODE)]
        await asyncio.gather(*(e.start() for e in [*prefills, *decodes]))
        prefill_pool = RoundRobinPool(prefills)
        service = KVService(
            kv_lifecycle_config(
                ttl_s=480,
                safety_margin_s=15,
                recompute_threshold_tokens=64,
                kv_bytes_per_token=KV_BYTES_PER_TOKEN,
                block_size_tokens=BLOCK,
            ),
            prefill=prefill_pool,
            settings=ServiceSettings(drain_timeout_s=30.0),
            clock=Clock(),
        )
        router = Router(
            prefill=prefill_pool,
            decode=RoundRobinPool(decodes),
            kv=service,
            settings=RouterSettings(
                pull_timeout_s=30.0, block_size_tokens=BLOCK, kv_bytes_per_token=KV_BYTES_PER_TOKEN
            ),
        )
        reports = await asyncio.gather(*(session(router, s) for s in range(NUM_SESSIONS)))
        held = {
            e.spec.engine_id: service.decider.lifecycle.bytes_held(e.spec.engine_id)
            for e in decodes
        }
        kept_blocks = sum(e.kv.num_used(e._clock()) for e in decodes)
        assert sum(held.values()) > 0 and kept_blocks > 0
        for s in range(NUM_SESSIONS):
            assert await service.close(f"s{s}")
        await service.wait_drains()
        assert service.counters["drains"] == NUM_SESSIONS
        assert service.counters["drain_failures"] == 0
        assert service.decider.lifecycle.records() == []
        # Every block a decode engine kept for a session has been read back and freed.
        assert sum(e.kv.num_used(e._clock()) for e in decodes) == 0
        await asyncio.gather(*(e.shutdown() for e in [*prefills, *decodes]))
        return reports, decodes

    reports, decodes = asyncio.run(story())
    turns = [r for rs in reports for r in rs]
    assert len(turns) == 3 * NUM_SESSIONS
    assert all(r.finish_reason == "length" and r.num_completion_tokens == 16 for r in turns)
    assert [r.kv_plan_reason for r in turns[::3]] == ["no_record"] * NUM_SESSIONS
    later = [r for rs in reports for r in rs[1:]]
    assert all(r.kv_source == "sent_back" for r in later), {r.kv_plan_reason for r in later}
    # The sessions spread over the decode pool; each engine's books were its own.
    assert len({e.spec.engine_id for e in decodes if e.stats().num_generation_tokens}) == NUM_DECODE
