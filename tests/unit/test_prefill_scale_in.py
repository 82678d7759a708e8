"""A prefill replica stopped by a scale-in keeps its engine until decode has read the
prompts' KV it keeps (``orchestrator/serve/hand_offs.py``), within their lease.

Simulated engines on one fabric and one virtual clock: a prefill engine, and a decode
engine that pulls the prompt's KV from it by the params the prefill returned, as a
turn's decode does once its prefill call has ended (and with it Serve's drain).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
from simulated_specs import llama_spec

from engines.base import GenerateChunk, GenerateRequest, KVTransferSpec
from engines.kv_params import KVTransferParams
from engines.simulated import SimulatedEngine, VirtualClock
from engines.simulated_kv import SimulatedFabric
from orchestrator.config import parse_config
from orchestrator.serve.engine_host import EngineHost, engine_deployment_options
from orchestrator.serve.hand_offs import hand_offs_read

PROMPT = list(range(1000, 1200))  # 200 tokens
KEEP = KVTransferParams.keep_for_decode()


def engines(clock: VirtualClock) -> tuple[SimulatedEngine, SimulatedEngine]:
    fabric = SimulatedFabric()
    # A failed pull fails the turn: the KV lost with a stopped engine is not hidden.
    kv = KVTransferSpec(kv_load_failure_policy="fail", prefill_lease_s=30)
    return tuple(  # type: ignore[return-value]
        SimulatedEngine(
            llama_spec(name, role, kv=kv, prefill_tokens_per_s=10_000.0),
            sleep=clock.sleep,
            clock=clock.time,
            fabric=fabric,
        )
        for name, role in (("p0", "prefill"), ("d0", "decode"))
    )


def request(request_id: str, max_tokens: int, params: KVTransferParams) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        prompt_token_ids=PROMPT,
        max_tokens=max_tokens,
        kv_transfer_params=params,
    )


async def collect(engine: SimulatedEngine, req: GenerateRequest) -> list[GenerateChunk]:
    return [chunk async for chunk in engine.generate(req)]


def stop_prefill_host(engine: SimulatedEngine, within_s: float) -> Coroutine[Any, Any, None]:
    """``EngineHost.__del__``, as Serve calls it on a stopping replica, of an autoscaled
    prefill host with ``engine`` (what ``__init__`` leaves for it to read). The host is
    a namespace, not an instance: the garbage collector calls no ``__del__`` of its own."""
    host_class = EngineHost.func_or_class
    host = SimpleNamespace(
        engine=engine,
        _retire=None,  # a prefill host moves no sessions
        _events_replica=None,
        _hand_offs_within_s=within_s,
    )
    host._wait_hand_offs = partial(host_class._wait_hand_offs, host)
    return host_class.__del__(host)  # type: ignore[no-any-return]


def test_a_stopping_prefill_host_keeps_its_engine_until_decode_has_read_the_prompts_kv() -> None:
    async def story() -> None:
        clock = VirtualClock()
        prefill, decode = engines(clock)
        await prefill.start()
        await decode.start()
        # A turn's prefill ends: its KV kept for decode, the call (and Serve's drain) over.
        params = (await collect(prefill, request("t1-p", 1, KEEP)))[-1].kv_transfer_params
        assert params is not None and prefill.stats().kv_cache_usage > 0
        # Serve stops the replica; its __del__ runs up to its first wait.
        stopping = asyncio.create_task(stop_prefill_host(prefill, 30.0))
        await asyncio.sleep(0)
        assert prefill.is_running and not stopping.done()
        # The turn's decode pulls the prompt's KV from the stopping engine.
        out = await collect(decode, request("t1-d", 8, params))
        assert out[-1].num_cached_tokens == len(PROMPT) - 1  # read, not recomputed
        assert decode.stats().num_kv_transfer_failures == 0
        # Read: the engine keeps nothing more and stops.
        await stopping
        assert not prefill.is_running
        await decode.shutdown()

    asyncio.run(story())


def test_kv_nobody_reads_holds_the_stop_no_longer_than_the_bound() -> None:
    async def story() -> None:
        clock = VirtualClock()
        prefill, _ = engines(clock)
        await prefill.start()
        # Nothing kept: the wait is over at once.
        assert await hand_offs_read(prefill.stats, within_s=10, clock=clock.time, sleep=clock.sleep)
        assert clock.now_s == 0.0
        await collect(prefill, request("t1-p", 1, KEEP))
        started_s = clock.now_s
        # Kept for a decode that never reads it: the wait ends at its bound, unread.
        read = await hand_offs_read(prefill.stats, within_s=10, clock=clock.time, sleep=clock.sleep)
        assert read is False
        assert clock.now_s - started_s == pytest.approx(10.0)
        assert prefill.stats().kv_cache_usage > 0
        await prefill.shutdown()

    asyncio.run(story())


def test_an_autoscaled_prefill_replica_gets_the_lease_to_stop_in() -> None:
    # Serve's force-kill comes graceful_shutdown_timeout_s after the stop: the drain of
    # its prefill calls (5 s, as before), then __del__'s wait, bounded by the lease.
    on = parse_config(
        {"autoscaling": {"enabled": True}, "kv": {"prefill_lease_s": 20}, "prefill": {}}
    )
    assert engine_deployment_options(on, "prefill")["graceful_shutdown_timeout_s"] == 5 + 20
    off = parse_config({"kv": {"prefill_lease_s": 20}})
    assert engine_deployment_options(off, "prefill")["graceful_shutdown_timeout_s"] == 5
