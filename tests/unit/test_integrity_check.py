"""The sampled KV integrity check: a reused turn's first tokens computed again without
reuse (``orchestrator.router.integrity``), and reuse turned off for the pull's engine
pair when they differ (``orchestrator.kv.integrity``), against fake pools and the real
KV service."""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

import msgspec
import pytest
from test_router import FakeClock, lifecycle_config

from engines.base import GenerateChunk, GenerateRequest, TokenLogprob
from engines.kv_params import KVTransferParams
from orchestrator.errors import InvalidRequest, ServiceUnavailable
from orchestrator.kv.durable import MemoryStore
from orchestrator.kv.messages import IntegrityMismatch, KVDecision
from orchestrator.kv.ownership import ANONYMOUS
from orchestrator.kv.service import KVService, ServiceSettings
from orchestrator.observability.metrics import Metrics
from orchestrator.router import Router, RouterSettings, Turn, TurnReport
from orchestrator.router.integrity import IntegritySettings
from orchestrator.serve.requests import parse_reuse_on
from policies.admission import EngineLoad
from policies.kv_cost import ExtendSettings
from policies.kv_records import RecomputeReason

# The decode's tokens and the log probability it gives each; the recompute gives the
# same, unless a test shifts them.
TOKENS = [11, 12, 13, 14]
DECODED = [-1.5, -0.25, -3.0, -2.0]
DECODE = "decode-r1"  # an extending decode engine, of pool "decode" as hosts name theirs


class Prefill:
    """A prefill pool of one engine, "P": a turn's prefill (pulls count as cached
    tokens) and the check's recompute, which gives ``prompt_logprobs`` at every position,
    off by ``shift`` at the turn's output tokens."""

    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []
        self.shift = 0.0

    async def _stream(self, req: GenerateRequest) -> Any:
        self.requests.append(req)
        params = req.kv_transfer_params or KVTransferParams()
        positions: list[list[TokenLogprob] | None] | None = None
        if req.prompt_logprobs is not None:
            ids = req.prompt_token_ids
            out = len(ids) - len(TOKENS)
            positions = [None] + [
                [TokenLogprob(ids[i], DECODED[i - out] + self.shift if i >= out else -9.0)]
                for i in range(1, len(ids))
            ]
        yield GenerateChunk(
            request_id=req.request_id,
            token_ids=[7],
            finished=True,
            num_cached_tokens=len(req.prompt_token_ids) - 4 if params.remote_block_ids else 0,
            kv_transfer_params=KVTransferParams(
                do_remote_prefill=True, remote_engine_id="P", remote_block_ids=((1, 2),)
            ),
            prompt_logprobs=positions,
            engine_id="P",
        )

    def generate(self, req: GenerateRequest) -> Any:
        return self._stream(req)


class Decode:
    """A decode pool of one engine, "D": four tokens, one a chunk, each with its log
    probability when asked (``logprobs``); keeps its blocks for the next turn."""

    def __init__(self, *, gives_logprobs: bool = True) -> None:
        self.requests: list[GenerateRequest] = []
        self.gives_logprobs = gives_logprobs

    async def _stream(self, req: GenerateRequest) -> Any:
        self.requests.append(req)
        n = len(req.prompt_token_ids)
        for i, (token, lp) in enumerate(zip(TOKENS, DECODED, strict=True)):
            last = i == len(TOKENS) - 1
            asked = req.logprobs is not None and self.gives_logprobs
            yield GenerateChunk(
                request_id=req.request_id,
                token_ids=[token],
                logprobs=[[TokenLogprob(token, lp)]] if asked else None,
                cumulative_logprob=sum(DECODED[: i + 1]) if asked else None,
                finished=last,
                finish_reason="length" if last else None,
                kv_transfer_params=KVTransferParams(
                    do_remote_decode=True,
                    remote_engine_id="D",
                    remote_request_id=req.request_id,
                    remote_block_ids=((5, 6, 7),),
                    remote_num_tokens=n + 3,
                )
                if last
                else None,
                engine_id="D" if last else None,
            )

    def generate(self, req: GenerateRequest) -> Any:
        return self._stream(req)


def make_router(
    prefill: Prefill,
    decode: Decode,
    *,
    fraction: float = 1.0,
    store: MemoryStore | None = None,
    drains: bool = False,
    extend: bool = False,
) -> Router:
    """A router over ``prefill`` and ``decode`` and a KV service; with ``extend``, turns
    of up to 8 new tokens are extended on decode engine ``DECODE`` (which reports itself
    idle)."""
    clock = FakeClock()

    def loads() -> list[EngineLoad]:
        return [
            EngineLoad(
                engine_id=DECODE,
                pool="decode",
                num_running=0,
                num_waiting=0,
                kv_cache_usage=0.1,
                num_finished=0,
                reported_s=clock.now_s,
            )
        ]

    service = KVService(
        lifecycle_config(),
        prefill=prefill if drains else None,
        settings=ServiceSettings(drain_timeout_s=5.0),
        clock=clock,
        store=store,
    )
    router = Router(
        prefill=prefill,
        decode=decode,
        kv=service,
        settings=RouterSettings(
            pull_timeout_s=5.0,
            integrity=IntegritySettings(sample_fraction=fraction, logprob_tolerance=0.01),
            # A turn extends with up to 16 tokens to compute in place: its new ones and the
            # history after its last whole 16-token block.
            extend=ExtendSettings(enabled=extend, max_new_tokens=16),
            decode_max_running=4,
        ),
        clock=clock,
        metrics=Metrics(),
        engine_loads=loads if extend else None,
    )
    router.integrity.rng = random.Random(0)
    return router


def service_of(router: Router) -> KVService:
    assert isinstance(router.kv, KVService)
    return router.kv


async def turn(
    router: Router, prompt: list[int], sampling_params: Any = None
) -> tuple[TurnReport, list[GenerateChunk]]:
    claim = await service_of(router).begin_turn("s", ANONYMOUS, prompt)
    assert claim.outcome == "claimed"
    items = [
        item
        async for item in router.run_turn(
            Turn(
                prompt_token_ids=prompt,
                max_tokens=4,
                session_id="s",
                decision=claim.decision,
                engine_sampling=sampling_params,
            )
        )
    ]
    await router.settled()
    await router.integrity.settled()
    return items[-1][1], [chunk for chunk, _ in items]


def checks(router: Router) -> dict[str, float]:
    snap = router.metrics.snapshot()
    prefix = 'kvtide_kv_integrity_checks_total{outcome="'
    return {k[len(prefix) : -2]: v for k, v in snap.items() if k.startswith(prefix)}


def conversation(router: Router, num_turns: int) -> list[TurnReport]:
    """``num_turns`` turns of session "s", each extending the last one."""

    async def run() -> list[TurnReport]:
        prompt, reports = list(range(100)), []
        for _ in range(num_turns):
            report, _ = await turn(router, prompt)
            reports.append(report)
            prompt = [*prompt, *TOKENS, 50, 51]
        return reports

    return asyncio.run(run())


def test_a_sampled_pull_is_recomputed_off_the_path_and_matches() -> None:
    prefill, decode = Prefill(), Decode()
    router = make_router(prefill, decode)
    first, second = conversation(router, 2)
    assert (first.kv_plan, second.kv_plan, second.kv_source) == ("recompute", "pull", "sent_back")
    # Only the pulling turn asked its decode for log probabilities.
    assert [r.logprobs for r in decode.requests] == [None, 0]
    # The check: the second turn's prompt and its four tokens, sessionless, no KV
    # transfer, with prompt log probabilities (vLLM then skips its prefix cache).
    check = prefill.requests[-1]
    assert check.request_id == f"{second.request_id}-i"
    assert check.prompt_token_ids == [*decode.requests[1].prompt_token_ids, *TOKENS]
    assert (check.max_tokens, check.prompt_logprobs) == (1, 0)
    assert check.kv_transfer_params is None and check.session_id is None
    assert checks(router) == {"match": 1.0}
    assert service_of(router).reuse_off.stats() == []


def test_a_client_that_did_not_ask_never_sees_the_checks_logprobs() -> None:
    prefill, decode = Prefill(), Decode()
    router = make_router(prefill, decode)

    class AskedFor:
        logprobs = 2

    async def run() -> tuple[list[GenerateChunk], list[GenerateChunk]]:
        await turn(router, list(range(100)))
        _, hidden = await turn(router, [*range(100), *TOKENS, 50])
        _, shown = await turn(router, [*range(100), *TOKENS, 50, *TOKENS, 60], AskedFor())
        return hidden, shown

    hidden, shown = asyncio.run(run())
    assert [(c.logprobs, c.cumulative_logprob) for c in hidden] == [(None, None)] * 4
    given = [[[TokenLogprob(t, lp)]] for t, lp in zip(TOKENS, DECODED, strict=True)]
    assert [c.logprobs for c in shown] == given
    assert checks(router) == {"match": 2.0}


def mismatched(router: Router, prefill: Prefill, plan: str) -> list[TurnReport]:
    """Three turns whose recompute disagrees with the reused turn's decode: the second
    reuses the first's KV by ``plan``, the third recomputes (one check, one mismatch)."""
    prefill.shift = 0.5
    reports = conversation(router, 3)
    assert [r.kv_plan for r in reports] == ["recompute", plan, "recompute"]
    assert reports[2].kv_plan_reason == "integrity_check_failed"
    assert reports[2].kv_source == "recomputed"
    assert checks(router) == {"mismatch": 1.0}
    return reports


def test_a_mismatch_turns_reuse_off_for_the_pair() -> None:
    prefill, decode = Prefill(), Decode()
    router = make_router(prefill, decode)
    reports = mismatched(router, prefill, "pull")
    service = service_of(router)
    [pair] = service.reuse_off.stats()
    assert (pair["prefill_engine_id"], pair["source_engine_id"]) == ("P", "D")
    assert pair["decode_engine_id"] == "D" and pair["session_id"] == "s"
    assert pair["request_id"] == reports[1].request_id
    assert pair["max_abs_diff"] == pytest.approx(0.5) and pair["tolerance"] == 0.01
    stats = asyncio.run(service.stats())
    assert stats["reuse_off"] == [pair]
    assert dict(stats["recomputes_by_reason"])[RecomputeReason.INTEGRITY_CHECK_FAILED] == 1

    # An operator turns it back on: the next turn pulls again.
    assert asyncio.run(service.reuse_on("P", "D")) is True
    assert asyncio.run(service.reuse_on("P", "D")) is False  # not off any more


def test_turned_back_on_the_next_extending_turn_pulls() -> None:
    prefill, decode = Prefill(), Decode()
    router = make_router(prefill, decode)
    prefill.shift = 0.5
    conversation(router, 2)
    service = service_of(router)
    assert asyncio.run(service.reuse_on("P", "D"))
    prefill.shift = 0.0
    # The session's record is still the second turn's (kept on D): a third turn pulls it.
    prompt = [*range(100), *TOKENS, 50, 51, *TOKENS, 50, 51]
    report, _ = asyncio.run(turn(router, prompt))
    assert (report.kv_plan, report.kv_source) == ("pull", "sent_back")
    assert checks(router) == {"mismatch": 1.0, "match": 1.0}


@pytest.mark.parametrize("shift", [0.0, 0.5])
def test_kept_kv_on_a_distrusted_engine_is_not_read_back(shift: float) -> None:
    """A drain is the read a mismatch found wrong, into the prefill engine's prefix
    cache: with reuse off for its engine the blocks wait for their TTL instead."""
    prefill, decode = Prefill(), Decode()
    prefill.shift = shift
    router = make_router(prefill, decode, drains=True)
    conversation(router, 2)
    service = service_of(router)

    async def close() -> None:
        assert await service.close("s")
        await service.wait_drains()

    asyncio.run(close())
    drains = [r for r in prefill.requests if r.request_id.startswith("drain-")]
    stats = service.drains.stats()
    if shift:  # the check failed: D is distrusted
        assert drains == [] and stats["num_drains_withheld"] == 1
    else:
        assert len(drains) == 1 and stats["num_drains_withheld"] == 0
        assert drains[0].kv_transfer_params is not None
        assert drains[0].kv_transfer_params.remote_engine_id == "D"


def test_reuse_off_outlives_a_service_restart() -> None:
    store = MemoryStore()
    prefill = Prefill()
    prefill.shift = 0.5
    conversation(make_router(prefill, Decode(), store=store), 2)
    # A new service on the same durable store: the pair is still off, and a pull from
    # D is refused.
    router = make_router(Prefill(), Decode(), store=store)
    service = service_of(router)
    assert [(p["prefill_engine_id"], p["source_engine_id"]) for p in service.reuse_off.stats()] == [
        ("P", "D")
    ]
    assert service.decider.lifecycle.reuse_off == frozenset({"D"})
    assert asyncio.run(service.reuse_on("P", "D"))
    assert store.keys("reuse_off/") == []
    assert service.decider.lifecycle.reuse_off == frozenset()


def test_a_pair_is_booked_once_and_each_pair_on_a_source_keeps_it_off() -> None:
    service = make_router(Prefill(), Decode()).kv
    assert isinstance(service, KVService)

    def mismatch(prefill: str) -> IntegrityMismatch:
        return IntegrityMismatch(prefill_engine_id=prefill, source_engine_id="D", max_abs_diff=1)

    assert asyncio.run(service.integrity_mismatch(mismatch("P1")))
    assert not asyncio.run(service.integrity_mismatch(mismatch("P1")))
    assert asyncio.run(service.integrity_mismatch(mismatch("P2")))
    assert asyncio.run(service.reuse_on("P1", "D"))
    # P2's pair still names D: the plan (made before a prefill engine is chosen) still
    # refuses pulls from D.
    assert service.decider.lifecycle.reuse_off == frozenset({"D"})
    assert asyncio.run(service.reuse_on("P2", "D"))
    assert service.decider.lifecycle.reuse_off == frozenset()


def test_a_held_turn_is_told_and_a_lease_granted_before_is_refused() -> None:
    """Under a turn lease the ingress plans the turn: the lease's record says reuse is
    off; a lease granted before the mismatch is refused when it pulls."""
    from policies.kv_lifecycle import KVLifecycle
    from policies.kv_records import KVLifecycleConfig

    kv = KVLifecycle(KVLifecycleConfig(recompute_threshold_tokens=4, kv_bytes_per_token=100))
    kv.on_turn_start("s", list(range(100)), now_s=0.0)
    kv.on_turn_finished(
        "s",
        engine_id="D",
        token_ids_covered=list(range(100)),
        block_ids=(1, 2, 3, 4, 5, 6, 7),
        transfer_params=None,
        expiry_s=480.0,
        now_s=1.0,
    )
    record = kv.hold("s", now_s=2.0)
    assert record is not None and kv.not_worth(record) is None
    kv.set_reuse_off(["D"])
    assert kv.not_worth(record) is RecomputeReason.INTEGRITY_CHECK_FAILED
    assert not kv.use_held("s", record=record, reason=None, now_s=3.0)
    assert kv.use_held("s", record=record, reason=RecomputeReason.INTEGRITY_CHECK_FAILED, now_s=3.0)


def test_unsampled_turns_ask_nothing_more() -> None:
    prefill, decode = Prefill(), Decode()
    router = make_router(prefill, decode, fraction=0.0)
    conversation(router, 3)
    assert [r.logprobs for r in decode.requests] == [None] * 3
    assert [r.prompt_logprobs for r in prefill.requests] == [None] * 3
    assert checks(router) == {}


def test_a_router_given_no_settings_checks_nothing() -> None:
    prefill, decode = Prefill(), Decode()
    service = service_of(make_router(prefill, decode))
    router = Router(
        prefill=prefill,
        decode=decode,
        kv=service,
        settings=RouterSettings(pull_timeout_s=5.0),
    )
    conversation(router, 3)
    assert [r.logprobs for r in decode.requests] == [None] * 3
    assert checks(router) == {}


def test_checks_past_the_running_limit_are_skipped() -> None:
    prefill, decode = Prefill(), Decode()
    router = make_router(prefill, decode)
    router.integrity.settings = IntegritySettings(sample_fraction=1.0, max_running=0)
    conversation(router, 2)
    assert checks(router) == {"skipped": 1.0}
    assert [r.prompt_logprobs for r in prefill.requests] == [None, None]


def test_a_check_whose_recompute_hangs_is_skipped_at_its_deadline() -> None:
    class HungRecompute(Prefill):
        async def _hung(self, req: GenerateRequest) -> Any:
            self.requests.append(req)
            await asyncio.Event().wait()  # the engine never answers the recompute
            yield GenerateChunk(request_id=req.request_id)

        def generate(self, req: GenerateRequest) -> Any:
            return self._hung(req) if req.prompt_logprobs is not None else self._stream(req)

    prefill, decode = HungRecompute(), Decode()
    router = make_router(prefill, decode)
    # Its deadline is server.request_timeout_s in the ingress; 0.2 s here.
    router.integrity.settings = IntegritySettings(sample_fraction=1.0, timeout_s=0.2)

    async def story() -> None:
        prompt = list(range(100))
        for _ in range(2):  # the second pulls the first's KV back: sampled
            await asyncio.wait_for(turn(router, prompt), 30.0)  # a hung check fails here
            prompt = [*prompt, *TOKENS, 50, 51]

    asyncio.run(story())
    assert [r.prompt_logprobs for r in prefill.requests][-1] == 0  # the check was sent
    assert checks(router) == {"skipped": 1.0}


def test_a_turn_sampled_under_a_grammar_is_skipped_not_failed() -> None:
    # vLLM applies a structured output's bitmask to the logits before its sampler, so
    # the decode's log probabilities are renormalised over what the grammar allows: a
    # recompute without the grammar differs by nats, and reuse would be turned off for
    # a KV that is right (a tool call with tool_choice "required", 9 nats off, on the
    # development box).
    class Constrained:
        structured_outputs = object()
        logprobs = None

    prefill, decode = Prefill(), Decode()
    router = make_router(prefill, decode)

    async def run() -> None:
        prompt = list(range(100))
        await turn(router, prompt, Constrained())
        await turn(router, [*prompt, *TOKENS, 50, 51], Constrained())

    asyncio.run(run())
    assert checks(router) == {"skipped": 1.0}
    assert [r.prompt_logprobs for r in prefill.requests] == [None, None]  # no check ran
    assert service_of(router).reuse_off.stats() == []


def test_a_decode_that_gives_no_logprobs_is_skipped_not_passed() -> None:
    prefill, decode = Prefill(), Decode(gives_logprobs=False)
    router = make_router(prefill, decode)
    conversation(router, 2)
    assert checks(router) == {"skipped": 1.0}
    assert [r.prompt_logprobs for r in prefill.requests] == [None, None]


def test_a_check_whose_request_fails_is_skipped() -> None:
    class Failing(Prefill):
        async def _stream(self, req: GenerateRequest) -> Any:
            if req.prompt_logprobs is not None:
                raise RuntimeError("engine died")
            async for chunk in super()._stream(req):
                yield chunk

    router = make_router(Failing(), Decode())
    conversation(router, 2)
    assert checks(router) == {"skipped": 1.0}
    assert service_of(router).reuse_off.stats() == []


def test_a_logprob_that_is_not_a_number_is_a_mismatch() -> None:
    prefill, decode = Prefill(), Decode()
    prefill.shift = math.nan
    router = make_router(prefill, decode)
    conversation(router, 2)
    assert checks(router) == {"mismatch": 1.0}
    assert service_of(router).reuse_off.stats()[0]["max_abs_diff"] == math.inf


def test_the_operator_body_names_the_missing_field() -> None:
    body = parse_reuse_on({"prefill_engine_id": "p", "source_engine_id": "d"})
    assert (body.prefill_engine_id, body.source_engine_id) == ("p", "d")
    with pytest.raises(InvalidRequest, match="source_engine_id"):
        parse_reuse_on({"prefill_engine_id": "p"})
    with pytest.raises(InvalidRequest, match="prefill_engine_id"):
        parse_reuse_on({"prefill_engine_id": "", "source_engine_id": "d"})
    with pytest.raises(InvalidRequest, match="engine"):
        parse_reuse_on({"prefill_engine_id": "p", "source_engine_id": "d", "engine": "x"})


def test_the_decode_asks_vllm_for_logprobs_only_where_the_client_asked_none() -> None:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from engines.vllm_sampling import sampling_args_for, sampling_params_for

    req = GenerateRequest(request_id="r", prompt_token_ids=[1, 2], max_tokens=4, logprobs=0)
    assert sampling_args_for(req)["logprobs"] == 0
    assert sampling_args_for(msgspec.structs.replace(req, logprobs=None))["logprobs"] is None
    own = sampling_params_for(
        msgspec.structs.replace(req, sampling_params=SamplingParams()), RequestOutputKind.DELTA
    )
    assert own.logprobs == 0
    clients = sampling_params_for(
        msgspec.structs.replace(req, sampling_params=SamplingParams(logprobs=3)),
        RequestOutputKind.DELTA,
    )
    assert clients.logprobs == 3


def test_the_fault_injection_scrambles_the_named_blocks_only() -> None:
    import torch

    from engines.kv_connector import corrupt_blocks

    values = torch.arange(24, dtype=torch.float32).reshape(3, 8) + 1
    pages = values.view(torch.uint8)  # one row of bytes per block, as the connector views
    corrupt_blocks(pages, [1], torch.float32)
    assert torch.equal(values[0], torch.arange(8, dtype=torch.float32) + 1)
    assert torch.equal(values[1], -4 * (torch.arange(8, 16, dtype=torch.float32) + 1))
    assert torch.equal(values[2], torch.arange(16, 24, dtype=torch.float32) + 1)


class ServiceLate:
    """The service, whose ``integrity_mismatch`` first hangs (past the try's deadline),
    then fails, then waits for ``reachable`` before it is delivered."""

    def __init__(self, service: KVService) -> None:
        self.service = service
        self.num_tries = 0
        self.reachable = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.service, name)

    async def integrity_mismatch(self, mismatch: IntegrityMismatch) -> bool:
        self.num_tries += 1
        if self.num_tries == 1:
            await asyncio.Event().wait()  # never answers: the try's deadline ends it
        if self.num_tries == 2:
            raise ServiceUnavailable("the KV lifecycle service did not answer in time")
        await self.reachable.wait()
        return await self.service.integrity_mismatch(mismatch)


def test_a_mismatch_the_service_has_not_heard_of_turns_reuse_off_here_and_is_sent_again() -> None:
    prefill, decode = Prefill(), Decode()
    router = make_router(prefill, decode)
    router.integrity.settings = IntegritySettings(
        sample_fraction=1.0, logprob_tolerance=0.01, report_timeout_s=0.05, report_backoff_s=0.0
    )
    service = service_of(router)
    late = ServiceLate(service)
    prefill.shift = 0.5  # the second turn's check disagrees

    async def run() -> list[TurnReport]:
        router.kv = late  # type: ignore[assignment]
        prompt, reports = list(range(100)), []
        for _ in range(2):
            reports.append((await turn_on(router, service, prompt))[0])
            prompt = [*prompt, *TOKENS, 50, 51]
        # The service has not heard of the mismatch: its plan still pulls from D, and
        # this replica recomputes all the same.
        assert service.reuse_off.stats() == []
        assert router.integrity.off_here == frozenset({"D"})
        report, given = await turn_on(router, service, prompt)
        assert given.kind == "pull" and given.kv_transfer_params is not None
        assert given.kv_transfer_params.remote_engine_id == "D"
        reports.append(report)
        late.reachable.set()
        await router.integrity.reported()
        return reports

    reports = asyncio.run(run())
    assert [r.kv_plan for r in reports] == ["recompute", "pull", "recompute"]
    assert reports[2].kv_plan_reason == "integrity_check_failed"
    assert reports[2].kv_source == "recomputed"
    # Sent until the service had it: a hung try, a failed one, the delivered one.
    assert late.num_tries == 3
    [pair] = service.reuse_off.stats()
    assert (pair["prefill_engine_id"], pair["source_engine_id"]) == ("P", "D")
    assert router.integrity.off_here == frozenset()  # the service's books decide now
    assert service.decider.lifecycle.reuse_off == frozenset({"D"})


async def turn_on(
    router: Router, service: KVService, prompt: list[int]
) -> tuple[TurnReport, KVDecision]:
    """``turn``, claimed from ``service`` (the router's ``kv`` is a stand-in for it):
    its report and the plan the service gave."""
    claim = await service.begin_turn("s", ANONYMOUS, prompt)
    assert claim.outcome == "claimed"
    items = [
        item
        async for item in router.run_turn(
            Turn(prompt_token_ids=prompt, max_tokens=4, session_id="s", decision=claim.decision)
        )
    ]
    await router.settled()
    await router.integrity.settled()
    assert claim.decision is not None
    return items[-1][1], claim.decision


class ServiceDown:
    """The service, whose ``integrity_mismatch`` fails its first ``num_failures`` tries."""

    def __init__(self, service: Any, num_failures: int) -> None:
        self.service = service
        self.num_failures = num_failures
        self.num_tries = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.service, name)

    async def integrity_mismatch(self, mismatch: IntegrityMismatch) -> bool:
        self.num_tries += 1
        if self.num_tries <= self.num_failures:
            raise ServiceUnavailable("the KV lifecycle service did not answer in time")
        return bool(await self.service.integrity_mismatch(mismatch))


def test_a_replica_shutting_down_first_delivers_its_mismatches(tiny_tokenizer: Any) -> None:
    from ingress_harness import bare_ingress

    from orchestrator.serve.ingress import Ingress

    ingress = bare_ingress(tiny_tokenizer, vllm=False)
    service = ingress.router.kv
    ingress.router.kv = down = ServiceDown(service, num_failures=3)
    ingress.router.integrity.settings = IntegritySettings(report_backoff_s=0.0)
    ingress._lease_watch = None

    async def run() -> None:
        ingress._reporter = asyncio.get_running_loop().create_future()
        mismatch = IntegrityMismatch(prefill_engine_id="P", source_engine_id="D", max_abs_diff=1)
        ingress.router.integrity.turn_off(mismatch)
        await Ingress.func_or_class.__del__(ingress)  # Serve's shutdown of the replica
        # The replica is gone only once the service has the mismatch.
        assert [p["source_engine_id"] for p in service.reuse_off.stats()] == ["D"]

    asyncio.run(run())
    assert down.num_tries == 4


class CachingDecode(Decode):
    """``Decode``'s engine, named ``DECODE``, with a prefix cache: a turn it computes
    itself (no remote prefill: an extended turn) finds the kept history there, and says
    so on every output, as vLLM does."""

    async def _stream(self, req: GenerateRequest) -> Any:
        in_place = not (req.kv_transfer_params or KVTransferParams()).do_remote_prefill
        async for chunk in super()._stream(req):
            if in_place:
                chunk = msgspec.structs.replace(chunk, num_cached_tokens=96)
            if chunk.finished:
                assert chunk.kv_transfer_params is not None
                kept = msgspec.structs.replace(chunk.kv_transfer_params, remote_engine_id=DECODE)
                chunk = msgspec.structs.replace(chunk, kv_transfer_params=kept, engine_id=DECODE)
            yield chunk


def turns_of(decode: Decode) -> list[GenerateRequest]:
    """The decode pool's turns, not its releases of kept blocks."""
    return [
        r
        for r in decode.requests
        if not (r.kv_transfer_params or KVTransferParams()).kvtide_release
    ]


def test_a_sampled_extended_turn_is_recomputed_off_the_path_and_matches() -> None:
    prefill, decode = Prefill(), CachingDecode()
    router = make_router(prefill, decode, extend=True)
    _, second = conversation(router, 2)
    assert (second.kv_plan, second.kv_source) == ("extend", "extended")
    # The extended turn's decode gave each token's log probability; the check recomputed
    # its prompt and tokens on the prefill pool without reuse.
    assert [r.logprobs for r in turns_of(decode)] == [None, 0]
    check = prefill.requests[-1]
    assert check.request_id == f"{second.request_id}-i"
    assert check.prompt_token_ids == [*turns_of(decode)[1].prompt_token_ids, *TOKENS]
    assert check.prompt_logprobs == 0 and check.kv_transfer_params is None
    assert checks(router) == {"match": 1.0}


def test_a_mismatch_on_an_extended_turn_turns_reuse_from_its_engine_off() -> None:
    prefill, decode = Prefill(), CachingDecode()
    router = make_router(prefill, decode, extend=True)
    reports = mismatched(router, prefill, "extend")
    # The pair: the decode engine computed from the KV it kept itself.
    [pair] = service_of(router).reuse_off.stats()
    assert (pair["prefill_engine_id"], pair["source_engine_id"]) == (DECODE, DECODE)
    assert pair["request_id"] == reports[1].request_id
