"""The per-turn choice between extending a session's kept KV on its decode engine and
pulling it to prefill (``policies.kv_cost.choose_plan``): a short increment on an idle
decode engine extends, a long one pulls, a saturated or full decode engine sends the turn
to prefill, and the ITL budget bounds what an in-place prefill may cost other streams."""

from __future__ import annotations

import pytest

from policies.kv_cost import ExtendSettings, PlanInputs, PlanReason, choose_plan
from policies.kv_records import HOST_POOL

NOW = 1000.0
# 1 ms per token in place, a 50 ms budget: 50 new tokens fit beside running streams.
SETTINGS = ExtendSettings(
    max_new_tokens=256,
    itl_budget_s=0.05,
    decode_prefill_s_per_token=0.001,
    max_kv_cache_usage=0.9,
    prefill_queue_waiting=2,
    max_load_age_s=5.0,
)


def inputs(num_new_tokens: int, **load: object) -> PlanInputs:
    """A turn offered a pull from a decode engine that reported 1 s ago: idle, KV
    cache 20 % used, 8 sequences at most; the prefill pool's queue empty."""
    given: dict[str, object] = {
        "history_pool": "decode",
        "decode_reported_s": NOW - 1.0,
        "decode_running": 0,
        "decode_waiting": 0,
        "decode_kv_cache_usage": 0.2,
        "decode_max_running": 8,
        "prefill_waiting": 0,
        **load,
    }
    return PlanInputs(num_new_tokens=num_new_tokens, **given)  # type: ignore[arg-type]


def test_a_short_increment_extends_on_the_decode_engine() -> None:
    choice = choose_plan(inputs(40), SETTINGS, NOW)
    assert (choice.extend, choice.reason) == (True, PlanReason.SHORT_INCREMENT)
    assert choice.extra_step_s == pytest.approx(0.040)


def test_a_long_increment_is_pulled_to_prefill() -> None:
    # 257 new tokens: one over max_new_tokens, on an idle decode engine.
    choice = choose_plan(inputs(257), SETTINGS, NOW)
    assert (choice.extend, choice.reason) == (False, PlanReason.LONG_INCREMENT)
    # At the bound it still extends.
    assert choose_plan(inputs(256), SETTINGS, NOW).extend


def test_a_long_increment_extends_when_the_prefill_pool_is_queued() -> None:
    choice = choose_plan(inputs(1000, prefill_waiting=2), SETTINGS, NOW)
    assert (choice.extend, choice.reason) == (True, PlanReason.PREFILL_QUEUED)
    assert not choose_plan(inputs(1000, prefill_waiting=1), SETTINGS, NOW).extend


@pytest.mark.parametrize(
    ("load", "reason"),
    [
        ({"decode_waiting": 1}, PlanReason.DECODE_SATURATED),
        ({"decode_running": 8}, PlanReason.DECODE_SATURATED),
        ({"decode_kv_cache_usage": 0.9}, PlanReason.DECODE_KV_FULL),
    ],
)
def test_a_saturated_decode_engine_sends_even_a_short_increment_to_prefill(
    load: dict[str, object], reason: PlanReason
) -> None:
    choice = choose_plan(inputs(8, **load), SETTINGS, NOW)
    assert (choice.extend, choice.reason) == (False, reason)


def test_the_itl_budget_bounds_an_in_place_prefill_beside_running_streams() -> None:
    # 51 new tokens cost 51 ms of the running streams' step: over the 50 ms budget.
    assert choose_plan(inputs(51, decode_running=3), SETTINGS, NOW).reason is (
        PlanReason.ITL_BUDGET
    )
    assert choose_plan(inputs(50, decode_running=3), SETTINGS, NOW).extend
    # Alone on the engine, nobody's ITL is at stake: the length bound decides.
    assert choose_plan(inputs(51), SETTINGS, NOW).extend


def test_history_in_a_host_tier_another_pool_or_with_an_unknown_load_is_pulled() -> None:
    assert choose_plan(inputs(8, history_pool=HOST_POOL), SETTINGS, NOW).reason is (
        PlanReason.HOST_TIER
    )
    assert choose_plan(inputs(8, in_turn_pool=False), SETTINGS, NOW).reason is (
        PlanReason.OTHER_DECODE_POOL
    )
    assert choose_plan(inputs(8, decode_reported_s=None), SETTINGS, NOW).reason is (
        PlanReason.NO_LOAD_REPORT
    )
    # A report older than max_load_age_s is not trusted; one at the bound is.
    assert choose_plan(inputs(8, decode_reported_s=NOW - 5.1), SETTINGS, NOW).reason is (
        PlanReason.NO_LOAD_REPORT
    )
    assert choose_plan(inputs(8, decode_reported_s=NOW - 5.0), SETTINGS, NOW).extend


def test_extending_off_always_pulls() -> None:
    off = ExtendSettings(enabled=False)
    assert choose_plan(inputs(1), off, NOW).reason is PlanReason.EXTEND_OFF


def test_the_itl_budget_prices_the_prefill_at_the_decode_engines_measured_cost() -> None:
    # 40 new tokens beside a running stream: 40 ms at the settings' 1 ms a token, within
    # the 50 ms budget; at the 2 ms a token the engine measured and reported, 80 ms: over.
    assert choose_plan(inputs(40, decode_running=1), SETTINGS, NOW).extend
    measured = choose_plan(
        inputs(40, decode_running=1, decode_prefill_s_per_token=0.002), SETTINGS, NOW
    )
    assert (measured.extend, measured.reason) == (False, PlanReason.ITL_BUDGET)
    assert measured.extra_step_s == pytest.approx(0.08)
    # A faster engine than the settings say: 100 tokens at 0.4 ms, 40 ms, extend.
    fast = inputs(100, decode_running=1, decode_prefill_s_per_token=0.0004)
    assert choose_plan(fast, SETTINGS, NOW).extend
    assert not choose_plan(inputs(100, decode_running=1), SETTINGS, NOW).extend


def test_an_engine_that_chunks_its_prefills_is_priced_one_chunk_a_step() -> None:
    # A decode engine that computes at most 35 prompt tokens of a request a step (vLLM's
    # long_prefill_token_threshold, which kvtide sets on a CPU decode pool that may
    # extend) adds one chunk's time to its other sequences' steps, however long the
    # increment: 130 new tokens at 1 ms are 35 ms a step, within the 50 ms budget.
    chunked = choose_plan(inputs(130, decode_running=3, decode_chunk_tokens=35), SETTINGS, NOW)
    assert (chunked.extend, chunked.reason) == (True, PlanReason.SHORT_INCREMENT)
    assert chunked.extra_step_s == pytest.approx(0.035)
    # The same increment in one step is 130 ms: over the budget.
    whole = choose_plan(inputs(130, decode_running=3), SETTINGS, NOW)
    assert (whole.extend, whole.reason) == (False, PlanReason.ITL_BUDGET)
    # A chunk that alone is over the budget is still refused: 60 tokens a step at 1 ms.
    wide = choose_plan(inputs(130, decode_running=3, decode_chunk_tokens=60), SETTINGS, NOW)
    assert wide.reason is PlanReason.ITL_BUDGET
    # An increment shorter than the chunk is priced whole.
    assert choose_plan(
        inputs(20, decode_running=3, decode_chunk_tokens=35), SETTINGS, NOW
    ).extra_step_s == pytest.approx(0.02)


def test_the_price_counts_the_history_after_its_last_whole_block() -> None:
    # vLLM's prefix cache hits whole blocks: a turn of 8 new tokens over a history of
    # 1,000 kept tokens in 128-token blocks hits 896 (7 blocks) and computes 112 in place,
    # 112 ms at 1 ms a token beside running streams: over the 50 ms budget.
    long_tail = inputs(8, decode_running=3, num_history_tokens=1000, block_size_tokens=128)
    assert long_tail.num_prefill_tokens == 112
    choice = choose_plan(long_tail, SETTINGS, NOW)
    assert (choice.extend, choice.reason, choice.num_prefill_tokens) == (
        False,
        PlanReason.ITL_BUDGET,
        112,
    )
    assert choice.extra_step_s == pytest.approx(0.112)
    # The same increment over a history that ends on a block computes only itself.
    aligned = inputs(8, decode_running=3, num_history_tokens=1024, block_size_tokens=128)
    assert choose_plan(aligned, SETTINGS, NOW).num_prefill_tokens == 8
    assert choose_plan(aligned, SETTINGS, NOW).extend
    # The bound on an increment's size counts the tail too: 8 new tokens over 1,000 kept
    # with 32-token blocks (992 cached) compute 16, over a bound of 15.
    bound = ExtendSettings(max_new_tokens=15)
    small_blocks = inputs(8, num_history_tokens=1000, block_size_tokens=32)
    assert choose_plan(small_blocks, bound, NOW).reason is PlanReason.LONG_INCREMENT
    # A prompt that adds nothing still computes its last token (vLLM recomputes it for
    # its logits), so its hit stops a block short where the history ends on one.
    assert inputs(0, num_history_tokens=1024, block_size_tokens=128).num_prefill_tokens == 128
