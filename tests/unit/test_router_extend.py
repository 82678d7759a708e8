"""A session's turn run where its KV already is (plan ``extend``), against fake pools,
the real KV service and the real cost function: a short increment goes straight to the
decode engine that kept the history, asking for that engine, with nothing to read; a long
one, a turn that asks for the plain pull, and a saturated decode engine pull as before."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from test_router import FakeClock, FakePool, decode_script, make_router, prefill_script

from engines.base import GenerateChunk, GenerateRequest
from engines.kv_params import KVTransferParams
from orchestrator.router import Router, Turn, TurnReport
from policies.admission import EngineLoad
from policies.kv_cost import ExtendSettings

HISTORY_CACHED = 96  # the whole blocks of turn 1's prompt and answer in decode's cache


ENGINE = "decode-r1"  # the decode engine (of pool "decode", as engine hosts name theirs)


def caching_decode(req: GenerateRequest) -> list[GenerateChunk]:
    """Decode engine ``ENGINE`` with a prefix cache: a request it prefills itself (no
    remote prefill to read) finds the kept history there and reads nothing over NIXL."""
    *chunks, last = decode_script(req)
    params = last.kv_transfer_params
    assert params is not None
    last = msgspec.structs.replace(
        last, kv_transfer_params=msgspec.structs.replace(params, remote_engine_id=ENGINE)
    )
    if (req.kv_transfer_params or KVTransferParams()).do_remote_prefill:
        return [*chunks, last]
    # vLLM gives the request's cache hit on every output, the first included.
    first, *middle = (
        msgspec.structs.replace(c, num_cached_tokens=HISTORY_CACHED) for c in [*chunks, last]
    )
    return [msgspec.structs.replace(first, kv_read_bytes=0), *middle]


def extend_router(
    prefill: FakePool, decode: FakePool, *, waiting: int = 0, running: int = 0
) -> Router:
    """A router whose engines report: decode engine ``ENGINE`` idle (or with ``waiting`` and
    ``running`` requests), its KV cache 10 % used; extends up to 8 new tokens."""

    def loads(clock: FakeClock) -> list[EngineLoad]:
        return [
            EngineLoad(
                engine_id=ENGINE,
                pool="decode",
                num_running=running,
                num_waiting=waiting,
                kv_cache_usage=0.1,
                num_finished=0,
                reported_s=clock.now_s,
            )
        ]

    return make_router(
        prefill,
        decode,
        kv_bytes_per_token=100,
        extend=ExtendSettings(max_new_tokens=8),
        decode_max_running=4,
        engine_loads=loads,
    )


async def turn(router: Router, prompt: list[int], **kw: Any) -> TurnReport:
    reports = [
        r
        async for _, r in router.run_turn(
            Turn(prompt_token_ids=prompt, max_tokens=3, session_id="s", **kw)
        )
    ]
    await router.settled()
    return reports[-1]


FIRST = list(range(100))
# Turn 1's prompt and answer (11, 12, 13), then the new tokens.
SHORT = [*FIRST, 11, 12, 13, 50, 51]
LONG = [*FIRST, 11, 12, 13, *range(200, 209)]  # 9 new tokens: one over the bound


def prefills(pool: FakePool) -> list[GenerateRequest]:
    return [r for r in pool.requests if not r.request_id.startswith("drain-")]


def test_a_short_increment_runs_on_the_decode_engine_that_kept_the_history() -> None:
    prefill, decode = FakePool(prefill_script(cached=101)), FakePool(caching_decode)
    router = extend_router(prefill, decode)
    r1 = asyncio.run(turn(router, FIRST))
    assert r1.extend_reason is None  # a first turn: the P/D path
    r2 = asyncio.run(turn(router, SHORT))
    # No prefill for turn 2; its decode computes the whole prompt on engine D, with no
    # remote prefill to read and its blocks kept for the next turn.
    assert len(prefills(prefill)) == 1
    ext = decode.requests[-1]
    assert ext.engine_id == ENGINE and ext.prompt_token_ids == SHORT
    assert ext.kv_transfer_params == KVTransferParams(kvtide_keep=True)
    assert (r2.kv_plan, r2.kv_plan_reason, r2.extend_reason) == (
        "extend",
        "reuse",
        "short_increment",
    )
    assert (r2.kv_source, r2.num_cached_tokens) == ("extended", HISTORY_CACHED)
    assert r2.kv_transfer_bytes == {"prefill_to_decode": 0, "decode_to_prefill": 0}
    assert r2.kv_offered_bytes == {"prefill_to_decode": 0, "decode_to_prefill": 0}
    # The service booked what decode kept for the extended turn: turn 3 extends it.
    r3 = asyncio.run(turn(router, [*SHORT, 11, 12, 13, 60]))
    assert r3.kv_plan == "extend"
    assert decode.requests[-1].engine_id == ENGINE
    metrics = router.metrics.snapshot()
    assert metrics["kvtide_kv_extends_total"] == 2
    assert metrics["kvtide_kv_send_backs_total"] == 0


def test_an_extended_turns_first_output_already_says_what_it_reused() -> None:
    # vLLM's serving layer takes a response's usage.prompt_tokens_details.cached_tokens
    # from the first output of the turn's stream: it must carry the decode's cache hit.
    prefill, decode = FakePool(prefill_script(cached=101)), FakePool(caching_decode)
    router = extend_router(prefill, decode)
    asyncio.run(turn(router, FIRST))

    async def first_output() -> tuple[int, str | None]:
        stream = router.run_turn(Turn(prompt_token_ids=SHORT, max_tokens=3, session_id="s"))
        _, report = await anext(stream)
        seen = (report.num_cached_tokens, report.kv_source)
        async for _ in stream:
            pass
        await router.settled()
        return seen

    assert asyncio.run(first_output()) == (HISTORY_CACHED, "extended")


def test_a_long_increment_is_pulled_to_prefill() -> None:
    prefill, decode = FakePool(prefill_script(cached=101)), FakePool(caching_decode)
    router = extend_router(prefill, decode)
    asyncio.run(turn(router, FIRST))
    r2 = asyncio.run(turn(router, LONG))
    assert (r2.kv_plan, r2.kv_source, r2.extend_reason) == ("pull", "sent_back", "long_increment")
    pull = prefills(prefill)[-1].kv_transfer_params
    assert pull is not None and pull.remote_engine_id == ENGINE
    assert decode.requests[-1].engine_id is None


def test_a_saturated_decode_engine_sends_a_short_increment_to_prefill() -> None:
    prefill, decode = FakePool(prefill_script(cached=101)), FakePool(caching_decode)
    router = extend_router(prefill, decode, waiting=1)
    asyncio.run(turn(router, FIRST))
    r2 = asyncio.run(turn(router, SHORT))
    assert (r2.kv_plan, r2.extend_reason) == ("pull", "decode_saturated")
    assert len(prefills(prefill)) == 2


def test_a_turn_that_may_not_extend_pulls() -> None:
    prefill, decode = FakePool(prefill_script(cached=101)), FakePool(caching_decode)
    router = extend_router(prefill, decode)
    asyncio.run(turn(router, FIRST))
    r2 = asyncio.run(turn(router, SHORT, may_extend=False))
    assert (r2.kv_plan, r2.kv_source, r2.extend_reason) == ("pull", "sent_back", None)
