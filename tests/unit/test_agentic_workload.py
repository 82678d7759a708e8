"""``benchmarks/agentic.py``'s workload and its summary, without a server: every setup
sees the same tokens, and the table's figures are what the turns say."""

from __future__ import annotations

from benchmarks.agentic import Run, Turn, Workload, arguments
from benchmarks.agentic_summary import Integrity, format_summaries, summarize, target

WORK = Workload(
    sessions=3,
    turns=4,
    shared_tokens=32,
    first_tokens=8,
    new_tokens=5,
    output_tokens=4,
    think_s=(0.0, 0.1),
    concurrency=2,
    seed=7,
)


def test_the_workload_is_the_same_tokens_every_time_and_sessions_share_their_prefix() -> None:
    again = Workload(**{**WORK.__dict__})
    assert WORK.shared() == again.shared() and len(WORK.shared()) == 32
    for s in range(WORK.sessions):
        assert WORK.additions(s) == again.additions(s)
        first, *later = WORK.additions(s)
        assert len(first) == 8 and [len(x) for x in later] == [5, 5, 5]
    assert WORK.additions(0) != WORK.additions(1)  # each session its own task
    assert WORK.think(1, 2) == again.think(1, 2) and 0.0 <= WORK.think(1, 2) <= 0.1


def _turn(index: int, ttft_s: float, moved: int | None, source: str = "sent_back") -> Turn:
    pulled = source != "recomputed"
    report = {
        "kv_source": source,
        "kv_plan": "pull" if pulled else "recompute",
        "kv_plan_reason": "reuse" if pulled else "evicted",
    }
    if moved is not None:
        report["kv_transfer_bytes"] = {"prefill_to_decode": moved, "decode_to_prefill": 0}
    turn = Turn(session=0, index=index, prompt_tokens=100, new_tokens=5, ttft_s=ttft_s)
    turn.gaps, turn.output_tokens, turn.report = [0.01, 0.02], 4, report
    return turn


def test_the_summary_reads_the_turns() -> None:
    turns = [
        _turn(1, 1.0, None, "recomputed"),
        _turn(2, 0.2, 5 * 4096),
        _turn(3, 0.3, 10 * 4096),
        _turn(4, 0.4, 5 * 4096, "recomputed"),
        _turn(5, 0.1, 6 * 4096, "prefix_cache"),
    ]
    failed = Turn(session=1, index=1, prompt_tokens=40, new_tokens=40, error="RuntimeError: 503")
    s = summarize(Run("kvtide", [*turns, failed], wall_s=2.0), WORK, 0.5, 4, 4096)
    assert (s.ok, s.failed) == (4 + 1, 1)
    assert s.ttft_by_turn == {1: 1.0, 2: 0.2, 3: 0.3, 4: 0.4}  # WORK has 4 turns
    assert s.ttft_p50_late == 0.4
    assert s.tokens_per_s == 20 / 2.0
    assert s.goodput == 4 / 2.0  # turns 2-5 within 0.5 s
    assert s.moved_ratio == 26 / 20  # 26 tokens' KV moved for 20 new tokens
    assert s.moved_ratio_cached == 6 / 5  # the turn whose history the prefill held
    assert s.sources == {"sent_back": 2, "recomputed": 1, "prefix_cache": 1}
    assert s.reasons == {"evicted": 1}
    table = format_summaries(
        [s],
        WORK,
        arguments().parse_args(["--kv-blocks", "64", "--budget-mib", "1"]),
    )
    assert "kvtide" in table and "1.30x" in table and "RuntimeError: 503" in table


def test_the_summary_prints_the_integrity_checks() -> None:
    s = summarize(Run("kvtide", [_turn(2, 0.2, 5 * 4096)], wall_s=1.0), WORK, 0.5, 4, 4096)
    host = summarize(Run("kvtide-host", [_turn(2, 0.2, 5 * 4096)], wall_s=1.0), WORK, 0.5, 4, 4096)
    args = arguments().parse_args(["--kv-blocks", "64", "--budget-mib", "1"])
    pair = {"prefill_engine_id": "prefill-a", "source_engine_id": "decode-b"}
    checks = {"match": 6, "mismatch": 1, "skipped": 2}
    tier = {"num_take_ins": 5, "bytes_taken_in": 3 * 2**20, "num_read_notifs": 4}
    integrity = {
        "kvtide": Integrity(checks=checks, reuse_off=[pair]),
        "kvtide-host": Integrity(checks=dict.fromkeys(checks, 0), reuse_off=[], host_tier=tier),
    }
    table = format_summaries([s, host], WORK, args, integrity)
    assert (
        "KV integrity checks (0.1 of pulled turns): 9: match 6, mismatch 1 (target 0), "
        "skipped 2; reuse off for: prefill-a <- decode-b"
    ) in table
    assert "host tier: 5 sessions taken in, 3.0 MiB, 4 pulled back, 0 expired there" in table


def test_each_target_is_met_or_missed_by_how_much() -> None:
    assert target("TTFT", 6.0, at_least=5.0) == "  TTFT = 6.00x (target >= 5x): met"
    assert target("TTFT", 2.5, at_least=5.0) == "  TTFT = 2.50x (target >= 5x): missed by 2.00x"
    assert target("moved", 1.1, at_most=1.1).endswith("(target <= 1.1x): met")
    assert target("moved", 3.3, at_most=1.1).endswith("missed by 3.00x")
    assert target("ITL", 1.0, below=1.0).endswith("(target < 1x): missed by 1.00x")
    assert target("ITL", 0.5, below=1.0).endswith("met")
    assert target("ITL", None, below=1.0) == "  ITL: not measured in this run"


def test_the_targets_read_the_extended_turns_and_the_setups_without_the_plan() -> None:
    extended = _turn(2, 0.1, 0)
    extended.report |= {"kv_plan": "extend", "extend_reason": "short_increment"}
    extended.gaps = [0.01] * 99 + [0.05]
    k = summarize(Run("kvtide", [extended], wall_s=1.0), WORK, 0.5, 4, 4096)
    pulled = summarize(
        Run("kvtide-pull", [_turn(2, 0.2, 5 * 4096)], wall_s=1.0), WORK, 0.5, 4, 4096
    )
    assert (k.num_extended, k.extended_moved, k.itl_p99) == (1, 0, 0.05)
    args = arguments().parse_args(["--kv-blocks", "64", "--budget-mib", "1"])
    table = format_summaries([k, pulled], WORK, args)
    assert "KV bytes moved for the 1 extended turns = 0 (target 0): met" in table
    assert "kvtide: 1 later turns extended on decode; extend or pull, by reason: " in table
    assert "by reason: short_increment 1" in table
    # p99 of 100 gaps, 50 ms against kvtide-pull's 20 ms.
    assert (
        "ITL p99 kvtide / kvtide-pull (without the plan) = 2.50x (target <= 1x): missed by 2.50x"
        in table
    )
