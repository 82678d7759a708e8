"""The KV lifecycle simulator: traces replayed through the real policy on a virtual clock.

Hand-written traces use round numbers: prefill at 10,000 tokens/s, decode at 50
tokens/s, so a turn of 2,000 prompt tokens and 50 output tokens is busy 0.2 s + 1 s.
The default policy config has a 480 s TTL and a 15 s margin: blocks kept at t are
offered until t + 465.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from policies.kv_lifecycle import KVLifecycleConfig, RecomputeReason
from policies.kv_sim import SimConfig, SimResult, simulate
from policies.kv_workload import (
    InvalidTrace,
    TraceTurn,
    WorkloadConfig,
    generate_workload,
    trace_from_jsonl,
    trace_to_jsonl,
)

POLICY = KVLifecycleConfig(prefill_tokens_per_s=10_000.0)
CONFIG = SimConfig(policy=POLICY, num_decode_engines=2, decode_tokens_per_s=50.0)
SMALL = WorkloadConfig(num_sessions=150, sessions_per_s=0.5)


def every(
    gap_s: float, *, num_sessions: int, num_turns: int, new_tokens: int = 160
) -> list[TraceTurn]:
    """Sessions 10 s apart, each sending a turn every ``gap_s`` (2,000-token first prompt)."""
    turns = [
        TraceTurn(
            session_id=f"s{s}",
            t_s=10.0 * s + gap_s * k,
            new_prompt_tokens=2_000 if k == 0 else new_tokens,
            output_tokens=50,
        )
        for s in range(num_sessions)
        for k in range(num_turns)
    ]
    return sorted(turns, key=lambda turn: turn.t_s)


def reasons(result: SimResult) -> dict[RecomputeReason, int]:
    return {reason: count for reason, count in result.recomputes_by_reason if count}


def test_a_seed_fixes_the_workload_and_the_result() -> None:
    trace = generate_workload(SMALL, seed=7)
    assert trace == generate_workload(SMALL, seed=7)
    assert trace != generate_workload(SMALL, seed=8)
    assert len({turn.session_id for turn in trace}) == 150
    assert [turn.t_s for turn in trace] == sorted(turn.t_s for turn in trace)
    config = replace(CONFIG, token_unit=16)
    assert simulate(trace, config) == simulate(trace, config)


def test_gaps_inside_the_ttl_pull_on_every_turn_after_the_first() -> None:
    # Turns 100 s apart; each ends 1.2 s after it starts: idle ~99 s < 465 s.
    trace = every(100.0, num_sessions=3, num_turns=4)
    result = simulate(trace, CONFIG)
    assert result.num_turns == 12
    assert result.num_pulls == 9
    assert result.hit_rate == (12 - 3) / 12
    assert reasons(result) == {RecomputeReason.NO_RECORD: 3}  # the first turns
    assert result.ttft_saved_s > 0
    assert result.ttft_saved_s == pytest.approx(result.recompute_s_avoided - result.transfer_s)


def test_gaps_past_the_ttl_never_pull() -> None:
    # Turns 600 s apart: every record passed its offer deadline (t + 465) long before.
    trace = every(600.0, num_sessions=3, num_turns=4)
    kept = SimConfig(
        policy=replace(POLICY, lease_ttl_s=3_600.0), num_decode_engines=2, decode_tokens_per_s=50.0
    )
    result = simulate(trace, kept)
    assert result.num_pulls == 0
    assert result.hit_rate == 0.0
    assert result.ttft_saved_s == 0.0
    assert reasons(result) == {RecomputeReason.NO_RECORD: 3, RecomputeReason.EXPIRED: 9}
    assert result.num_expiries == 9
    # With the lease equal to the TTL (as the orchestrator sets it), kvtide has also
    # forgotten the session by the next turn: the policy reports no_record.
    forgotten = simulate(trace, CONFIG)
    assert forgotten.num_pulls == 0
    assert reasons(forgotten) == {RecomputeReason.NO_RECORD: 12}


def test_a_rewritten_history_recomputes_with_prefix_mismatch() -> None:
    trace = every(100.0, num_sessions=1, num_turns=4)
    trace[2] = replace(trace[2], rewrite_history=True)
    result = simulate(trace, CONFIG)
    # Turn 2 pulls, turn 3 finds its prompt rewritten, turn 4 pulls turn 3's KV.
    assert result.num_pulls == 2
    assert reasons(result) == {
        RecomputeReason.NO_RECORD: 1,
        RecomputeReason.PREFIX_MISMATCH: 1,
    }
    # Turn 3 superseded turn 2's record, whose tokens the session no longer starts
    # with: the router cannot drain it, and the engine keeps it until its TTL.
    assert (result.num_drains, result.num_undrainable) == (0, 1)


def test_a_turn_sent_early_waits_for_the_previous_one() -> None:
    # The second turn arrives while the first still decodes (busy 0.2 s + 1 s).
    trace = [
        TraceTurn(session_id="s", t_s=0.0, new_prompt_tokens=2_000, output_tokens=50),
        TraceTurn(session_id="s", t_s=0.5, new_prompt_tokens=160, output_tokens=50),
    ]
    result = simulate(trace, CONFIG)
    assert result.num_pulls == 1
    # Turn 2 starts at 1.2 s, pulls 2,049 tokens, prefills 161 more, decodes 1 s.
    transfer_s = result.transfer_s
    assert result.end_s == pytest.approx(1.2 + transfer_s + 161 / 10_000 + 1.0)


def test_memory_counts_whole_blocks_per_engine() -> None:
    # One turn: 1,600 prompt tokens + 1 output token -> 1,600 tokens kept = 100 blocks.
    trace = [TraceTurn(session_id="s", t_s=0.0, new_prompt_tokens=1_600, output_tokens=1)]
    result = simulate(trace, CONFIG)
    block_bytes = 16 * POLICY.kv_bytes_per_token
    assert result.peak_held_bytes_per_engine == 100 * block_bytes
    assert result.peak_pinned_bytes_per_engine == 100 * block_bytes
    assert result.peak_idle_bytes_per_engine == 100 * block_bytes


def test_a_longer_ttl_never_lowers_hit_rate_or_peak_memory() -> None:
    trace = generate_workload(SMALL, seed=3)
    results = [
        simulate(
            trace,
            SimConfig(
                policy=replace(POLICY, ttl_s=ttl, lease_ttl_s=ttl),
                num_decode_engines=2,
                token_unit=16,
            ),
        )
        for ttl in (60.0, 120.0, 240.0, 480.0, 960.0)
    ]
    hit_rates = [r.hit_rate for r in results]
    peaks = [r.peak_held_bytes_per_engine for r in results]
    assert hit_rates == sorted(hit_rates)
    assert peaks == sorted(peaks)
    assert hit_rates[0] < hit_rates[-1]  # the sweep is not flat on this workload


def test_idle_memory_never_exceeds_the_budget() -> None:
    trace = generate_workload(SMALL, seed=3)
    unbounded = simulate(trace, replace(CONFIG, token_unit=16))
    budget = unbounded.peak_idle_bytes_per_engine // 4
    config = replace(
        CONFIG, policy=replace(POLICY, idle_budget_bytes_per_engine=budget), token_unit=16
    )
    bounded = simulate(trace, config)
    assert bounded.peak_idle_bytes_per_engine <= budget
    assert bounded.num_evictions > 0
    assert bounded.num_recomputes_for(RecomputeReason.EVICTED) > 0
    assert bounded.hit_rate < unbounded.hit_rate
    # The router drains evicted records; without drains the engines would keep
    # their blocks until the TTL, on top of the new ones.
    assert bounded.num_drains >= bounded.num_evictions
    undrained = simulate(trace, replace(config, drain=False))
    assert undrained.num_drains == 0
    assert undrained.peak_pinned_bytes_per_engine > 2 * bounded.peak_pinned_bytes_per_engine


def test_token_units_replay_whole_blocks_like_tokens() -> None:
    # With every count a multiple of 16, units of 16 tokens book the same blocks.
    trace = every(100.0, num_sessions=4, num_turns=5, new_tokens=160)
    trace = [replace(turn, output_tokens=48) for turn in trace]
    exact = simulate(trace, CONFIG)
    coarse = simulate(trace, replace(CONFIG, token_unit=16))
    assert coarse.num_pulls == exact.num_pulls == 16
    assert coarse.recomputes_by_reason == exact.recomputes_by_reason
    assert coarse.peak_held_bytes_per_engine == exact.peak_held_bytes_per_engine
    assert coarse.peak_pinned_bytes_per_engine == exact.peak_pinned_bytes_per_engine
    assert coarse.mean_held_bytes_per_engine == pytest.approx(exact.mean_held_bytes_per_engine)
    assert coarse.ttft_saved_s == pytest.approx(exact.ttft_saved_s, rel=1e-3)
    with pytest.raises(ValueError, match="token_unit=5"):
        SimConfig(token_unit=5)


def test_the_jsonl_trace_round_trips() -> None:
    trace = generate_workload(SMALL, seed=1)
    assert any(turn.rewrite_history for turn in trace)
    text = trace_to_jsonl(trace)
    assert text.splitlines()[0].startswith('{"session_id": ')
    assert trace_from_jsonl(text.splitlines()) == trace
    assert trace_from_jsonl(["", text.splitlines()[0], "  "]) == trace[:1]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", r"trace line 1: not JSON"),
        ("[1, 2]", r"trace line 1: expected a JSON object"),
        ('{"session_id": "a", "t_s": 0}', r"missing new_prompt_tokens, output_tokens"),
        (
            '{"session_id": "a", "t_s": -1, "new_prompt_tokens": 5, "output_tokens": 1}',
            r"t_s=-1",
        ),
        (
            '{"session_id": "a", "t_s": 0, "new_prompt_tokens": 5, "output_tokens": 0}',
            r"output_tokens=0; use an integer >= 1",
        ),
        (
            '{"session_id": "a", "t_s": 0, "new_prompt_tokens": 2.5, "output_tokens": 1}',
            r"new_prompt_tokens=2.5",
        ),
        (
            '{"session_id": "a", "t_s": 0, "new_prompt_tokens": 0, "output_tokens": 1}',
            r"session 'a': its first turn .* new_prompt_tokens=0",
        ),
    ],
)
def test_an_invalid_trace_line_is_named(line: str, message: str) -> None:
    with pytest.raises(InvalidTrace, match=message):
        trace_from_jsonl([line])


def test_public_names_are_pinned() -> None:
    import policies.kv_sim
    import policies.kv_sim_memory
    import policies.kv_workload

    assert sorted(policies.kv_sim.__all__) == ["SimConfig", "SimResult", "simulate"]
    assert sorted(policies.kv_sim_memory.__all__) == ["EngineMemory"]
    assert sorted(policies.kv_workload.__all__) == [
        "InvalidTrace",
        "TraceTurn",
        "WorkloadConfig",
        "generate_workload",
        "trace_from_jsonl",
        "trace_to_jsonl",
    ]
