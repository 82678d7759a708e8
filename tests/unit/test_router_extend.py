"""A session's turn run where its KV already is (plan ``extend``), against fake pools,
the real KV service and the real cost function: a short increment goes straight to the
decode engine that kept the history, asking for that engine, with nothing to read; a long
one, a turn that asks for the plain pull, and a saturated decode engine pull as before.
Once an extended turn is booked, its engine frees the previous turn's kept blocks
unread; an extended turn that fails leaves them booked for the next turn."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from test_router import (
    FakeClock,
    FakePool,
    decode_script,
    lifecycle_config,
    make_router,
    prefill_script,
    service_of,
)

from engines.base import EngineStats, GenerateChunk, GenerateRequest
from engines.kv_params import KVTransferParams
from orchestrator.kv.envelope import decode_result
from orchestrator.kv.service import KVService, ServiceSettings
from orchestrator.router import Router, Turn, TurnReport
from orchestrator.serve.admission import AdmissionGate
from orchestrator.serve.engine_host import heartbeat_stats
from policies.admission import AdmissionSettings, EngineLoad
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
    prefill: FakePool,
    decode: FakePool,
    *,
    waiting: int = 0,
    running: int = 0,
    prefill_s_per_token: float | None = None,
    prefill_chunk_tokens: int | None = None,
    max_new_tokens: int = 16,
    decode_chunk_tokens: int | None = None,
) -> Router:
    """A router whose engines report: decode engine ``ENGINE`` idle (or with ``waiting`` and
    ``running`` requests), its KV cache 10 % used (and the prefill time per token it
    measured and the chunk it prefills in, if given); extends a turn of up to
    ``max_new_tokens`` computed in place; ``decode_chunk_tokens``: the deployed chunk."""

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
                prefill_s_per_token=prefill_s_per_token,
                prefill_chunk_tokens=prefill_chunk_tokens,
            )
        ]

    return make_router(
        prefill,
        decode,
        kv_bytes_per_token=100,
        extend=ExtendSettings(max_new_tokens=max_new_tokens),
        decode_max_running=4,
        decode_chunk_tokens=decode_chunk_tokens,
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
# Turn 1's prompt and answer (11, 12, 13), then the new tokens. Turn 1 kept 102 tokens
# (its answer's last never computed), 96 of them in whole 16-token blocks: the decode
# engine computes a later turn's tokens from the 97th on.
SHORT = [*FIRST, 11, 12, 13, 50, 51]  # 3 new tokens, 9 computed in place
LONG = [*FIRST, 11, 12, 13, *range(200, 210)]  # 17 computed in place: one over the bound


def prefills(pool: FakePool) -> list[GenerateRequest]:
    return [r for r in pool.requests if not r.request_id.startswith("drain-")]


def releases(pool: FakePool) -> list[GenerateRequest]:
    """The decode pool's requests that free kept blocks unread."""
    return [r for r in pool.requests if (r.kv_transfer_params or KVTransferParams()).kvtide_release]


def decodes(pool: FakePool) -> list[GenerateRequest]:
    """The decode pool's turns (not its releases)."""
    return [r for r in pool.requests if r not in releases(pool)]


def test_a_short_increment_runs_on_the_decode_engine_that_kept_the_history() -> None:
    prefill, decode = FakePool(prefill_script(cached=101)), FakePool(caching_decode)
    router = extend_router(prefill, decode)
    r1 = asyncio.run(turn(router, FIRST))
    assert r1.extend_reason is None  # a first turn: the P/D path
    r2 = asyncio.run(turn(router, SHORT))
    # No prefill for turn 2; its decode computes the whole prompt on engine D, with no
    # remote prefill to read and its blocks kept for the next turn.
    assert len(prefills(prefill)) == 1
    ext = decodes(decode)[-1]
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
    assert decodes(decode)[-1].engine_id == ENGINE
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


def test_the_bound_on_an_increment_counts_the_history_after_its_last_whole_block() -> None:
    # SHORT adds 3 tokens to turn 1's 102 kept ones, but the decode engine's prefix
    # cache holds whole 16-token blocks only (96 tokens): it would compute 9 in place.
    # Over a bound of 8, the turn is pulled; at 9 it extends, and its report's figure is
    # what the engine computed (the prompt less its cache hit).
    prefill, decode = FakePool(prefill_script(cached=101)), FakePool(caching_decode)
    router = extend_router(prefill, decode, max_new_tokens=8)
    asyncio.run(turn(router, FIRST))
    r2 = asyncio.run(turn(router, SHORT))
    assert (r2.kv_plan, r2.extend_reason) == ("pull", "long_increment"), r2
    assert r2.extend_prefill_tokens == 9
    prefill, decode = FakePool(prefill_script(cached=101)), FakePool(caching_decode)
    router = extend_router(prefill, decode, max_new_tokens=9)
    asyncio.run(turn(router, FIRST))
    r2 = asyncio.run(turn(router, SHORT))
    assert (r2.kv_plan, r2.extend_reason) == ("extend", "short_increment"), r2
    assert r2.extend_prefill_tokens == len(SHORT) - r2.num_cached_tokens == 9
    assert r2.as_dict()["extend_prefill_tokens"] == 9


def test_a_long_increment_is_pulled_to_prefill() -> None:
    prefill, decode = FakePool(prefill_script(cached=101)), FakePool(caching_decode)
    router = extend_router(prefill, decode)
    asyncio.run(turn(router, FIRST))
    r2 = asyncio.run(turn(router, LONG))
    assert (r2.kv_plan, r2.kv_source, r2.extend_reason) == ("pull", "sent_back", "long_increment")
    pull = prefills(prefill)[-1].kv_transfer_params
    assert pull is not None and pull.remote_engine_id == ENGINE
    assert decode.requests[-1].engine_id is None
    assert releases(decode) == []  # the pull read the blocks: vLLM freed them


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


def test_an_extended_turn_once_booked_frees_the_previous_turns_blocks_unread() -> None:
    prefill = FakePool(prefill_script(cached=101))
    booked_at_release: list[str | None] = []

    def decode_engine(req: GenerateRequest) -> list[GenerateChunk]:
        if (req.kv_transfer_params or KVTransferParams()).kvtide_release:
            record = service_of(router).decider.lifecycle.record("s")
            kept = None if record is None else record.transfer_params
            assert kept is None or isinstance(kept, KVTransferParams)
            booked_at_release.append(None if kept is None else kept.remote_request_id)
        return caching_decode(req)

    decode = FakePool(decode_engine)
    router = extend_router(prefill, decode)
    asyncio.run(turn(router, FIRST))
    first_kept = decodes(decode)[0].request_id  # the fake keeps under the request's id
    asyncio.run(turn(router, SHORT))
    # One release, on the engine that kept turn 1, naming turn 1's kept request; one
    # token computed there and nothing read (no prefill, no pull params).
    (release,) = releases(decode)
    assert release.engine_id == ENGINE
    assert release.kv_transfer_params == KVTransferParams(
        kvtide_keep=False, kvtide_release=first_kept
    )
    assert release.max_tokens == 1 and release.prompt_token_ids == SHORT[:1]
    assert len(prefills(prefill)) == 1
    # Sent once the service had booked the extended turn's record (turn 2's decode).
    assert booked_at_release == [decodes(decode)[1].request_id]


def test_an_extended_turn_that_fails_leaves_the_previous_record_for_the_next_turn() -> None:
    prefill, decode = FakePool(prefill_script(cached=101)), FakePool(caching_decode)
    router = extend_router(prefill, decode)
    asyncio.run(turn(router, FIRST))
    first_kept = decodes(decode)[0].request_id

    async def client_leaves_after_one_token() -> None:
        stream = router.run_turn(
            Turn(prompt_token_ids=SHORT, max_tokens=3, session_id="s", request_id="gone")
        )
        async for _ in stream:
            break
        await stream.aclose()
        await router.settled()

    asyncio.run(client_leaves_after_one_token())
    assert decodes(decode)[-1].request_id.startswith("gone")
    assert releases(decode) == []  # not booked: nothing freed
    # The extended turn read nothing: turn 1's record is offered again, and the next
    # turn extends it (and frees it once booked).
    r3 = asyncio.run(turn(router, SHORT))
    assert (r3.kv_plan, r3.extend_reason) == ("extend", "short_increment"), r3
    (release,) = releases(decode)
    assert release.kv_transfer_params == KVTransferParams.release(first_kept)


def test_the_decode_engines_reported_prefill_cost_prices_the_itl_budget() -> None:
    """The engine's heartbeat carries the prefill time per token its host measured
    (``heartbeat_stats``); the service passes it with the engine's load, the ingress
    reads it, and the cost function prices the in-place prefill with it: 9 tokens
    computed in place beside a running stream at 20 ms a token is 180 ms, over the 50 ms
    budget, where the settings' 1.4 ms would extend."""
    service = KVService(
        lifecycle_config(), prefill=None, settings=ServiceSettings(drain_timeout_s=5.0)
    )
    load = {"num_running": 1, "kv_cache_usage": 0.1, "num_requests": 3}
    measured = heartbeat_stats(EngineStats(engine_id=ENGINE, **load), 0.02)  # type: ignore[arg-type]
    unmeasured = heartbeat_stats(EngineStats(engine_id="decode-r2", **load), None)  # type: ignore[arg-type]
    asyncio.run(service.heartbeat(ENGINE, stats=measured))
    asyncio.run(service.heartbeat("decode-r2", stats=unmeasured))
    gate = AdmissionGate(AdmissionSettings(), pools=["prefill", "decode"])
    asyncio.run(gate.refresh(service))
    loads = {view.load.engine_id: view.load for view in gate.book.views()}
    assert loads[ENGINE].prefill_s_per_token == 0.02
    assert loads["decode-r2"].prefill_s_per_token is None  # none reported: the settings'

    prefill, decode = FakePool(prefill_script(cached=101)), FakePool(caching_decode)
    router = extend_router(prefill, decode, running=1, prefill_s_per_token=0.02)
    asyncio.run(turn(router, FIRST))
    r2 = asyncio.run(turn(router, SHORT))
    assert (r2.kv_plan, r2.extend_reason) == ("pull", "itl_budget")
    router = extend_router(
        FakePool(prefill_script(cached=101)), FakePool(caching_decode), running=1
    )
    asyncio.run(turn(router, FIRST))
    assert asyncio.run(turn(router, SHORT)).extend_reason == "short_increment"


def test_a_step_is_priced_at_the_chunk_the_decode_engine_reports() -> None:
    """The deploy chunks the decode pool's prefills at 35 tokens (1.4 ms a token in a
    50 ms budget); an engine that measured 1.45 ms runs 34, fitted by its host, and
    reports it with its cost: a turn computing more than a chunk in place beside a
    running stream then adds 34 x 1.45 = 49.3 ms a step, within the budget, where a
    35-token chunk at that cost would be 50.75 ms, over it."""
    service = KVService(
        lifecycle_config(), prefill=None, settings=ServiceSettings(drain_timeout_s=5.0)
    )
    load = {"num_running": 1, "kv_cache_usage": 0.1, "num_requests": 3}
    beat = heartbeat_stats(EngineStats(engine_id=ENGINE, **load), 0.00145, 34)  # type: ignore[arg-type]
    asyncio.run(service.heartbeat(ENGINE, stats=beat))
    gate = AdmissionGate(AdmissionSettings(), pools=["prefill", "decode"])
    # The loads as the service's actor answers an ingress: every figure a float.
    answer = msgspec.msgpack.encode(asyncio.run(service.engine_loads()))
    gate.observe(decode_result("engine_loads", answer))
    [seen] = [view.load for view in gate.book.views()]
    assert (seen.prefill_s_per_token, seen.prefill_chunk_tokens) == (0.00145, 34)

    def second_turn(chunk: int | None) -> TurnReport:
        router = extend_router(
            FakePool(prefill_script(cached=101)),
            FakePool(caching_decode),
            running=1,
            prefill_s_per_token=0.00145,
            prefill_chunk_tokens=chunk,
            max_new_tokens=64,
            decode_chunk_tokens=35,
        )
        asyncio.run(turn(router, FIRST))
        # 38 new tokens, 44 computed in place: more than a chunk.
        return asyncio.run(turn(router, [*FIRST, 11, 12, 13, *range(300, 337)]))

    fitted = second_turn(34)
    assert (fitted.kv_plan, fitted.extend_reason) == ("extend", "short_increment"), fitted
    # Without the engine's chunk, the deployed one is priced: over the budget.
    assert second_turn(None).extend_reason == "itl_budget"
