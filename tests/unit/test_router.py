"""The router's turn flow against hand-written fake pools and the real KV planner."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
from service_fakes import ServiceFake

from engines.base import GenerateChunk, GenerateRequest
from engines.kv_params import KVTransferParams
from orchestrator.cluster.route_notes import RouteNotes
from orchestrator.errors import DeadlineExceeded, EngineUnavailable
from orchestrator.kv.decider import kv_lifecycle_config
from orchestrator.kv.messages import Handover, TurnDone
from orchestrator.kv.ownership import ANONYMOUS
from orchestrator.kv.service import KVService, ServiceSettings
from orchestrator.kv.session_tokens import SessionTokens
from orchestrator.router import Router, RouterSettings, Turn, TurnReport
from policies.kv_records import KVLifecycleConfig
from policies.prefix_routing import RouteChoice

Script = Callable[[GenerateRequest], list[GenerateChunk]]


class FakePool:
    """A pool whose engine answers by script; records every request it gets."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[GenerateRequest] = []
        self.hang_pulls = False

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self.requests.append(request)
        params = request.kv_transfer_params or KVTransferParams()
        if self.hang_pulls and params.remote_block_ids:
            await asyncio.Event().wait()  # a KV pull that never completes
        for chunk in self.script(request):
            yield chunk

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        return self._stream(request)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        self.now_s += 0.001
        return self.now_s


def prefill_script(
    cached: int = 0, fail_pulls: bool = False, read_bytes: int | None = None
) -> Script:
    """``read_bytes``: what the engine says a pull read (``kv_read_bytes``; None: it does
    not say); a prefill that pulls nothing reads 0."""

    def run(req: GenerateRequest) -> list[GenerateChunk]:
        params = req.kv_transfer_params or KVTransferParams()
        if fail_pulls and params.remote_block_ids:
            raise RuntimeError("NIXL read declined: blocks expired")
        return [
            GenerateChunk(
                request_id=req.request_id,
                token_ids=[7],
                finished=True,
                finish_reason="length",
                num_prompt_tokens=len(req.prompt_token_ids),
                num_cached_tokens=cached if params.remote_block_ids else 0,
                kv_transfer_params=KVTransferParams(
                    do_remote_prefill=True, remote_engine_id="P", remote_block_ids=((1, 2),)
                ),
                kv_read_bytes=read_bytes if params.remote_block_ids else 0,
            )
        ]

    return run


def decode_script(req: GenerateRequest) -> list[GenerateChunk]:
    """Three tokens, then final params pointing at the blocks decode kept."""
    n = len(req.prompt_token_ids)
    return [
        GenerateChunk(request_id=req.request_id, text="a", token_ids=[11]),
        GenerateChunk(request_id=req.request_id, text="b", token_ids=[12]),
        GenerateChunk(
            request_id=req.request_id,
            text="c",
            token_ids=[13],
            finished=True,
            finish_reason="length",
            num_prompt_tokens=n,
            kv_transfer_params=KVTransferParams(
                do_remote_decode=True,
                remote_engine_id="D",
                remote_request_id=req.request_id,
                remote_block_ids=((5, 6, 7),),
                remote_num_tokens=n + 2,
            ),
        ),
    ]


def keeping_decode_script(req: GenerateRequest) -> list[GenerateChunk]:
    """A decode engine with kvtide's connector: it keeps its blocks (and says so in its
    final params) only when the request's params ask (``kvtide_keep``)."""
    chunks = decode_script(req)
    params = req.kv_transfer_params
    if params is None or params.kvtide_keep is not True:
        chunks[-1] = msgspec.structs.replace(chunks[-1], kv_transfer_params=None)
    return chunks


class CountingService(ServiceFake):
    """The real service as the router reaches it, counting the turns it hands over."""

    num_turns_done = 0

    async def turn_done(self, done: TurnDone) -> Handover:
        self.num_turns_done += 1
        return await self.service.turn_done(done)


def lifecycle_config() -> KVLifecycleConfig:
    """The KV books the router tests run on: 4 tokens are worth a pull."""
    return kv_lifecycle_config(
        ttl_s=480,
        safety_margin_s=15,
        recompute_threshold_tokens=4,
        kv_bytes_per_token=100,
        block_size_tokens=16,
    )


def make_router(prefill: FakePool, decode: FakePool, **kw: Any) -> Router:
    """A router and, as ``router.kv``, a KV service in the same process (the service
    drains through the same fake prefill pool)."""
    clock = FakeClock()
    service = KVService(
        lifecycle_config(),
        prefill=prefill,
        settings=ServiceSettings(drain_timeout_s=5.0),
        clock=clock,
    )
    return Router(
        prefill=prefill,
        decode=decode,
        kv=service,
        settings=RouterSettings(
            pull_timeout_s=kw.get("pull_timeout_s", 5.0),
            block_size_tokens=kw.get("block_size_tokens", 16),
            kv_bytes_per_token=kw.get("kv_bytes_per_token", 0),
            **{
                k: kw[k] for k in ("extend", "decode_max_running", "decode_chunk_tokens") if k in kw
            },
        ),
        clock=clock,
        prefill_routes=kw.get("prefill_routes"),
        session_tokens=SessionTokens(ttl_s=480),
        # ``engine_loads``: the engines' reports, made from the router's clock.
        engine_loads=(lambda: kw["engine_loads"](clock)) if "engine_loads" in kw else None,
    )


def service_of(router: Router) -> KVService:
    assert isinstance(router.kv, KVService)
    return router.kv


async def turn(router: Router, prompt: list[int], session: str | None) -> TurnReport:
    reports = [
        r
        async for _, r in router.run_turn(
            Turn(prompt_token_ids=prompt, max_tokens=3, session_id=session)
        )
    ]
    await router.settled()
    return reports[-1]


def test_one_turn_hands_prefill_params_to_decode() -> None:
    prefill, decode = FakePool(prefill_script()), FakePool(decode_script)
    report = asyncio.run(turn(make_router(prefill, decode), list(range(100)), None))
    [pre] = [r for r in prefill.requests if not r.request_id.startswith("drain-")]
    assert pre.max_tokens == 1 and pre.kv_transfer_params == KVTransferParams.keep_for_decode()
    [dec] = decode.requests
    assert dec.max_tokens == 3 and dec.kv_transfer_params is not None
    assert dec.kv_transfer_params.remote_engine_id == "P"
    assert (report.kv_source, report.kv_plan_reason) == ("recomputed", "no_session")
    assert report.num_completion_tokens == 3 and report.finish_reason == "length"


def test_second_turn_pulls_the_kv_decode_kept() -> None:
    prefill, decode = FakePool(prefill_script(cached=101)), FakePool(decode_script)
    router = make_router(prefill, decode)
    first = list(range(100))
    r1 = asyncio.run(turn(router, first, "s"))
    assert r1.kv_plan_reason == "no_record"
    # Turn 2 extends turn 1's prompt + its three output tokens.
    r2 = asyncio.run(turn(router, [*first, 11, 12, 13, 50, 51], "s"))
    pull = prefill.requests[1].kv_transfer_params
    assert pull is not None
    assert pull.remote_engine_id == "D" and pull.remote_block_ids == ((5, 6, 7),)
    assert pull.do_remote_decode is True and pull.do_remote_prefill is False
    assert (r2.kv_plan, r2.kv_source, r2.num_cached_tokens) == ("pull", "sent_back", 101)


def test_history_that_does_not_extend_the_record_is_recomputed() -> None:
    prefill, decode = FakePool(prefill_script(cached=101)), FakePool(decode_script)
    router = make_router(prefill, decode)
    asyncio.run(turn(router, list(range(100)), "s"))
    r2 = asyncio.run(turn(router, [999, *range(1, 100), 11, 12, 50], "s"))
    assert (r2.kv_plan, r2.kv_plan_reason) == ("recompute", "prefix_mismatch")
    assert prefill.requests[1].kv_transfer_params == KVTransferParams.keep_for_decode()


def test_failed_pull_becomes_a_plain_prefill_and_the_turn_completes() -> None:
    prefill = FakePool(prefill_script(cached=101, fail_pulls=True))
    decode = FakePool(decode_script)
    router = make_router(prefill, decode)
    asyncio.run(turn(router, list(range(100)), "s"))
    r2 = asyncio.run(turn(router, [*range(100), 11, 12, 13, 50], "s"))
    assert r2.pull_fallback and r2.kv_source == "recomputed"
    assert [r.request_id.endswith("-r") for r in prefill.requests] == [False, False, True]
    assert r2.num_completion_tokens == 3
    assert service_of(router).decider.stats()["num_declines"] == 1


def test_hung_pull_is_bounded_by_the_timeout_and_the_turn_completes() -> None:
    prefill, decode = FakePool(prefill_script()), FakePool(decode_script)
    router = make_router(prefill, decode, pull_timeout_s=0.05)
    asyncio.run(turn(router, list(range(100)), "s"))
    prefill.hang_pulls = True  # the pull never answers; the plain prefill does
    r2 = asyncio.run(turn(router, [*range(100), 11, 12, 13, 50], "s"))
    assert r2.kv_plan == "pull" and r2.pull_fallback and r2.num_completion_tokens == 3
    assert service_of(router).decider.stats()["num_declines"] == 1


def test_decode_failure_mid_stream_keeps_no_record() -> None:
    def broken(req: GenerateRequest) -> list[GenerateChunk]:
        raise RuntimeError("engine died")

    prefill, decode = FakePool(prefill_script()), FakePool(broken)
    router = make_router(prefill, decode)
    # The client is told which pool failed, never the engine's own error text.
    with pytest.raises(EngineUnavailable, match="the decode failed") as caught:
        asyncio.run(turn(router, list(range(100)), "s"))
    assert "engine died" not in str(caught.value.body())
    lifecycle = service_of(router).decider.lifecycle
    assert lifecycle.record("s") is None
    assert lifecycle.pulls_in_flight() == []


def test_prefill_without_params_is_an_engine_error() -> None:
    def no_params(req: GenerateRequest) -> list[GenerateChunk]:
        return [GenerateChunk(request_id=req.request_id, finished=True, token_ids=[1])]

    router = make_router(FakePool(no_params), FakePool(decode_script))
    with pytest.raises(EngineUnavailable, match="kv_transfer_config"):
        asyncio.run(turn(router, [1, 2, 3], None))


def test_blocks_nobody_will_pull_are_drained_back_to_prefill() -> None:
    prefill, decode = FakePool(prefill_script()), FakePool(decode_script)
    router = make_router(prefill, decode)

    async def run() -> None:
        # A request without a session: decode kept its blocks, nobody will ask for them.
        await turn(router, list(range(100)), None)
        await service_of(router).wait_drains()

    asyncio.run(run())
    drain = prefill.requests[-1]
    assert drain.request_id.startswith("drain-") and drain.max_tokens == 1
    assert drain.kv_transfer_params is not None
    assert drain.kv_transfer_params.remote_block_ids == ((5, 6, 7),)
    assert drain.kv_transfer_params.do_remote_prefill is False
    # Nobody decodes after a drain: the prefill engine frees its copy at once.
    assert drain.kv_transfer_params.kvtide_keep is False
    # The drain reads exactly the tokens the blocks hold: prompt + output.
    assert drain.prompt_token_ids == [*range(100), 11, 12, 13]
    assert service_of(router).counters["drains"] == 1


def test_a_sessionless_request_keeps_nothing_on_decode_and_costs_no_drain() -> None:
    # Decode runs kvtide's connector: it keeps blocks only when asked.
    prefill, decode = FakePool(prefill_script()), FakePool(keeping_decode_script)
    router = make_router(prefill, decode)
    service = service_of(router)
    router.kv = counting = CountingService(service)

    async def run() -> TurnReport:
        report = await turn(router, list(range(100)), None)
        await service.wait_drains()
        return report

    report = asyncio.run(run())
    assert report.num_completion_tokens == 3
    # The decode was asked to free its blocks, and did: no params came back.
    [dec] = decode.requests
    assert dec.kv_transfer_params is not None and dec.kv_transfer_params.kvtide_keep is False
    # Two engine requests in all (prefill, decode): no read-back, nothing booked.
    assert [r.request_id.startswith("drain-") for r in prefill.requests] == [False]
    assert counting.num_turns_done == 0 and service.counters["drains"] == 0


def test_a_session_turn_asks_decode_to_keep_its_blocks_for_the_next_turn() -> None:
    prefill, decode = FakePool(prefill_script(cached=101)), FakePool(keeping_decode_script)
    router = make_router(prefill, decode)
    first = list(range(100))
    asyncio.run(turn(router, first, "s"))
    assert decode.requests[0].kv_transfer_params is not None
    assert decode.requests[0].kv_transfer_params.kvtide_keep is True
    r2 = asyncio.run(turn(router, [*first, 11, 12, 13, 50], "s"))
    assert (r2.kv_plan, r2.kv_source) == ("pull", "sent_back")
    # The pulling prefill keeps its own copy for the decode that reads it.
    pull = prefill.requests[1].kv_transfer_params
    assert pull is not None and pull.kvtide_keep is True


def test_closing_a_session_drains_its_record_only_with_matching_tokens() -> None:
    prefill, decode = FakePool(prefill_script()), FakePool(decode_script)
    router = make_router(prefill, decode)
    service = service_of(router)

    async def run() -> None:
        await turn(router, list(range(100)), "a")
        await turn(router, list(range(100)), "b")
        # The service kept each session's tokens with its record; corrupt b's.
        service.tokens.remember("b", None, [*range(1, 101), 11, 12, 13], service.clock())
        assert await service.close("a") and await service.close("b")
        assert not await service.close("a")  # closing twice: nothing left to close
        await service.wait_drains()

    asyncio.run(run())
    drains = [r for r in prefill.requests if r.request_id.startswith("drain-")]
    # The record covers 102 tokens (prompt + two outputs); the drain sends one more.
    assert [d.prompt_token_ids for d in drains] == [[*range(100), 11, 12, 13]]
    assert (service.counters["drains"], service.counters["undrainable"]) == (1, 1)


def test_the_next_turn_continues_from_the_tokens_the_model_generated() -> None:
    prefill, decode = FakePool(prefill_script()), FakePool(decode_script)
    router = make_router(prefill, decode)

    async def run() -> None:
        reports = [
            r
            async for _, r in router.run_turn(
                Turn(prompt_token_ids=[1, 2, 3], max_tokens=3, session_id="s", prompt_text="hi")
            )
        ]
        assert reports[-1].finish_reason == "length"
        await router.settled()
        prefix = await router.kv.session_prefix("s")
        assert (prefix.text, prefix.token_ids) == ("hiabc", [1, 2, 3, 11, 12, 13])

    asyncio.run(run())


def test_prompts_above_the_threshold_decode_on_the_long_context_pool() -> None:
    prefill = FakePool(prefill_script())
    short, long = FakePool(decode_script), FakePool(decode_script)
    base = make_router(prefill, short)
    router = Router(
        prefill=prefill,
        decode=short,
        kv=base.kv,
        settings=RouterSettings(pull_timeout_s=5.0, long_context_threshold_tokens=100),
        decode_long=long,
    )
    reports = [asyncio.run(turn(router, list(range(n)), None)) for n in (100, 101, 250)]
    assert [r.decode_pool for r in reports] == ["decode", "decode_long", "decode_long"]
    assert [len(q.prompt_token_ids) for q in short.requests] == [100]
    assert [len(q.prompt_token_ids) for q in long.requests] == [101, 250]
    assert reports[1].as_dict()["decode_pool"] == "decode_long"


def test_a_long_context_pool_needs_its_threshold() -> None:
    pool = FakePool(decode_script)
    with pytest.raises(ValueError, match="long_context_threshold_tokens"):
        Router(
            prefill=pool,
            decode=pool,
            kv=make_router(pool, pool).kv,
            settings=RouterSettings(pull_timeout_s=1.0),
            decode_long=pool,
        )


class HangingPool(FakePool):
    """An engine whose queue is full: it accepts the request and never answers."""

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self.requests.append(request)
        await asyncio.Event().wait()
        yield GenerateChunk(request_id=request.request_id)  # never reached


def test_a_hung_prefill_ends_at_the_request_deadline_and_frees_the_session() -> None:
    prefill, decode = HangingPool(prefill_script()), FakePool(decode_script)
    router = make_router(prefill, decode)
    router.request_timeout_s = 0.2
    service = service_of(router)

    async def run() -> None:
        assert (await service.claim_session("s", ANONYMOUS)).outcome == "claimed"
        with pytest.raises(DeadlineExceeded) as caught:
            await turn(router, list(range(100)), "s")
        assert caught.value.status_code == 503 and caught.value.headers()["Retry-After"] == "1"
        assert decode.requests == []
        # The turn was abandoned: the session may run its next turn at once.
        assert (await service.claim_session("s", ANONYMOUS)).outcome == "claimed"
        assert service.decider.lifecycle.record("s") is None

    asyncio.run(run())


def test_a_decode_that_stops_streaming_ends_at_the_request_deadline() -> None:
    prefill, decode = FakePool(prefill_script()), HangingPool(decode_script)
    router = make_router(prefill, decode)
    router.request_timeout_s = 0.2
    with pytest.raises(DeadlineExceeded, match="decode was still running"):
        asyncio.run(turn(router, list(range(100)), None))


class DiesAfterTwoTokens(FakePool):
    """The first decode request streams two tokens, then its engine dies."""

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self.requests.append(request)
        chunks = self.script(request)
        if len(self.requests) == 1:
            for chunk in chunks[:2]:
                yield chunk
            raise RuntimeError("ActorDiedError: the replica's worker process died")
        for chunk in chunks:
            yield chunk


def test_a_turn_whose_decode_engine_dies_continues_on_another_without_repeating() -> None:
    def counting(req: GenerateRequest) -> list[GenerateChunk]:
        # Each decode request streams up to max_tokens tokens 11, 12, 13, ...
        n = len(req.prompt_token_ids)
        ids = list(range(11, 11 + req.max_tokens))
        chunks = [
            GenerateChunk(request_id=req.request_id, text=f"<{i}>", token_ids=[i]) for i in ids
        ]
        # Its engine read 10 B per prompt token (on the first chunk, as engines say).
        chunks[0] = msgspec.structs.replace(chunks[0], kv_read_bytes=10 * n)
        last = chunks[-1]
        chunks[-1] = GenerateChunk(
            request_id=req.request_id,
            text=last.text,
            token_ids=last.token_ids,
            finished=True,
            finish_reason="length",
            num_prompt_tokens=n,
            kv_transfer_params=KVTransferParams(
                do_remote_decode=True,
                remote_engine_id="D2",
                remote_request_id=req.request_id,
                remote_block_ids=((8, 9),),
                remote_num_tokens=n + req.max_tokens - 1,
            ),
        )
        return chunks

    prefill, decode = FakePool(prefill_script()), DiesAfterTwoTokens(counting)
    router = make_router(prefill, decode)
    prompt = list(range(100))

    async def run() -> tuple[list[int], TurnReport]:
        seen: list[int] = []
        reports: list[TurnReport] = []
        async for chunk, report in router.run_turn(
            Turn(prompt_token_ids=prompt, max_tokens=5, session_id="s")
        ):
            seen.extend(chunk.token_ids)
            reports.append(report)
        return seen, reports[-1]

    seen, report = asyncio.run(run())
    _, second = decode.requests
    # Two tokens came from the engine that died; the other decodes the rest of the turn
    # from the prompt plus those two (prefilled again), so the client sees each once.
    assert second.prompt_token_ids == [*prompt, 11, 12] and second.max_tokens == 3
    assert seen == [11, 12, 11, 12, 13]
    assert report.migrations == 1 and report.num_completion_tokens == 5
    assert [r.request_id.rsplit("-", 1)[1] for r in prefill.requests] == ["p", "m1"]
    # Both decode engines read a prompt: the turn moved both reads.
    assert report.kv_transfer_bytes["prefill_to_decode"] == 10 * 100 + 10 * 102
    # The session's record is the surviving engine's, covering the whole turn.
    record = service_of(router).decider.lifecycle.record("s")
    assert record is not None and record.engine_id == "D2"


def test_a_migrated_turn_whose_new_prefill_returns_no_params_is_a_503_not_a_crash() -> None:
    # The first prefill carries params; the one run again after the decode engine died
    # comes from an engine without a KV connector. The turn fails as the first prefill
    # would have: engine unavailable (503), not an assertion (500).
    def params_only_first(req: GenerateRequest) -> list[GenerateChunk]:
        [chunk] = prefill_script()(req)
        if req.request_id.endswith("-p"):
            return [chunk]
        return [msgspec.structs.replace(chunk, kv_transfer_params=None)]

    prefill, decode = FakePool(params_only_first), DiesAfterTwoTokens(decode_script)
    router = make_router(prefill, decode)

    async def run() -> None:
        async for _ in router.run_turn(
            Turn(prompt_token_ids=list(range(100)), max_tokens=5, session_id="s")
        ):
            pass

    with pytest.raises(EngineUnavailable, match="no kv_transfer_params") as caught:
        asyncio.run(run())
    assert caught.value.status_code == 503
    # The new prefill is run again elsewhere, as for an engine that died, and no more.
    assert [r.request_id.rsplit("-", 1)[1] for r in prefill.requests] == [
        "p",
        *(f"m1{n}" if n else "m1" for n in range(1 + router.max_migrations)),
    ]
    assert len(decode.requests) == 1


class PrefillDies(FakePool):
    """A prefill pool whose first ``failures`` requests land on an engine that dies."""

    def __init__(self, script: Script, failures: int) -> None:
        super().__init__(script)
        self.failures = failures

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self.requests.append(request)
        if len(self.requests) <= self.failures:
            raise RuntimeError("ActorDiedError: the prefill replica's worker process died")
        for chunk in self.script(request):
            yield chunk


def test_a_turn_whose_prefill_engine_dies_is_prefilled_again_on_another() -> None:
    prefill, decode = PrefillDies(prefill_script(), failures=1), FakePool(decode_script)
    router = make_router(prefill, decode)
    report = asyncio.run(turn(router, list(range(100)), "s"))
    assert report.finish_reason == "length" and report.num_completion_tokens == 3
    assert report.prefill_retries == 1 and report.as_dict()["prefill_retries"] == 1
    # Two prefill requests under distinct ids (an engine rejects a duplicate id); decode
    # got the surviving engine's KV.
    assert [r.request_id.rsplit("-", 1)[1] for r in prefill.requests] == ["p", "p1"]
    [dec] = decode.requests
    assert dec.kv_transfer_params is not None
    assert dec.kv_transfer_params.remote_block_ids == ((1, 2),)
    assert router.metrics.snapshot()["kvtide_kv_recomputes_total"] == 1


def test_a_prefill_failing_on_every_engine_is_503_after_the_bounded_retries() -> None:
    prefill, decode = PrefillDies(prefill_script(), failures=99), FakePool(decode_script)
    router = make_router(prefill, decode)
    service = service_of(router)

    async def run() -> None:
        assert (await service.claim_session("s", ANONYMOUS)).outcome == "claimed"
        with pytest.raises(EngineUnavailable) as caught:
            await turn(router, list(range(100)), "s")
        assert caught.value.status_code == 503
        # max_migrations retries after the first attempt, then no more engine work.
        assert len(prefill.requests) == 1 + router.max_migrations
        assert decode.requests == []
        assert (await service.claim_session("s", ANONYMOUS)).outcome == "claimed"

    asyncio.run(run())


def test_the_report_names_the_prefill_engine_and_why_the_router_chose_it() -> None:
    # The engine host names itself on the final chunk; the request router leaves its
    # choice under the prefill request's id.
    notes = RouteNotes()

    def on_p1(req: GenerateRequest) -> list[GenerateChunk]:
        notes.put(
            req.request_id,
            RouteChoice(replica="p1", reason="prefix_match", num_matched_tokens=96),
        )
        return [msgspec.structs.replace(c, engine_id="prefill-p1") for c in prefill_script()(req)]

    router = make_router(FakePool(on_p1), FakePool(decode_script), prefill_routes=notes.take)
    report = asyncio.run(turn(router, list(range(100)), None)).as_dict()
    assert report["prefill_replica"] == "prefill-p1"
    assert (report["prefill_route_reason"], report["prefill_matched_tokens"]) == (
        "prefix_match",
        96,
    )

    # Without prefix routing, Serve balanced by load.
    def plain(req: GenerateRequest) -> list[GenerateChunk]:
        return [msgspec.structs.replace(c, engine_id="prefill-p0") for c in prefill_script()(req)]

    plain_report = asyncio.run(
        turn(make_router(FakePool(plain), FakePool(decode_script)), list(range(100)), None)
    ).as_dict()
    assert plain_report["prefill_replica"] == "prefill-p0"
    assert (plain_report["prefill_route_reason"], plain_report["prefill_matched_tokens"]) == (
        "pow2",
        0,
    )

    # With prefix routing, a request the router left no note for: Serve chose by load.
    router = make_router(FakePool(plain), FakePool(decode_script), prefill_routes=notes.take)
    report = asyncio.run(turn(router, list(range(100)), None)).as_dict()
    assert (report["prefill_route_reason"], report["prefill_matched_tokens"]) == ("unrecorded", 0)


def test_the_report_carries_the_decode_engines_step_time() -> None:
    # The decode engine's finished chunk says how long its steps took by its own clock:
    # the measure a client's gaps between stream events are held to.
    def timed_decode(req: GenerateRequest) -> list[GenerateChunk]:
        chunks = decode_script(req)
        chunks[-1] = msgspec.structs.replace(chunks[-1], engine_step_s=0.0125)
        return chunks

    router = make_router(FakePool(prefill_script()), FakePool(timed_decode))
    report = asyncio.run(turn(router, list(range(100)), None)).as_dict()
    assert report["decode_step_s"] == 0.0125
    untimed = asyncio.run(
        turn(make_router(FakePool(prefill_script()), FakePool(decode_script)), [1] * 100, None)
    ).as_dict()
    assert untimed["decode_step_s"] is None
