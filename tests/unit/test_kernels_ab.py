"""The engine-level A/B's pure parts and the timing statistics, on CPU.

No engine starts here: ``kvtide kernels ab --dry-run`` shows the two sides' engine args,
the comparison of two sides' greedy tokens is checked on hand-made records, and an A/B
evidence file backs a validated scope only where it ran (arch, TP/DCP, vLLM, batches).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kernels import ab, cli
from kernels.coverage import covers
from kernels.gate import ValidatedScope
from kernels.scope import KIMI_K3
from kernels.timing import quantile, summarize


def record(
    tokens: list[int],
    start: float = 0.1,
    gap: float = 0.01,
    tops: list[dict[int, float]] | None = None,
) -> ab.RequestRecord:
    arrivals = tuple(start + gap * i for i in range(len(tokens)))
    return ab.RequestRecord(
        token_ids=tuple(tokens), arrival_s=arrivals, top_logprobs=tuple(tops or ())
    )


def test_dry_run_shows_two_sides_that_differ_only_by_the_paths_config(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["ab", "--model", "/m", "--tp", "8", "--dcp", "8", "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    stock, path = plan["stock"], plan["path"]
    assert path.pop("additional_config") == {"decode_backend": "latency_specialized"}
    assert stock == path
    assert stock["decode_context_parallel_size"] == 8 and stock["max_num_seqs"] == 1024
    assert plan["batches"] == [1, 4, 16, 64, 256, 1024]
    # The self-check runs two stock engines: evidence for nothing, a check of the machinery.
    assert cli.main(["ab", "--model", "/m", "--self-check", "--batch", "2", "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["stock"] == plan["path"] and plan["batches"] == [2]


def test_equal_tokens_pass_and_report_latencies() -> None:
    stock = [record([5, 6, 7]), record([1, 2], start=0.3)]
    result = ab.compare(2, stock, [record([5, 6, 7], gap=0.008), record([1, 2], start=0.2)])
    assert result.passed and result.tokens_equal and result.divergence is None
    assert result.stock.ttft_ms_median == pytest.approx(200.0)
    assert result.stock.itl_ms_median == pytest.approx(10.0)
    assert result.path.itl_ms_median < result.stock.itl_ms_median


def test_a_divergence_at_a_near_tie_passes_and_a_confident_one_fails() -> None:
    tops = [{5: -0.1}, {6: -0.70, 9: -0.72}, {7: -0.2}]
    stock = [record([5, 6, 7], tops=tops)]
    tie = ab.compare(1, stock, [record([5, 9, 4])])
    assert tie.passed and not tie.tokens_equal
    assert tie.divergences == (tie.divergence,)
    assert tie.divergence == ab.Divergence(
        request=0, position=1, stock_token=6, path_token=9, margin=pytest.approx(0.02)
    )
    wrong = ab.compare(
        1, [record([5, 6, 7], tops=[{5: -0.1}, {6: -0.1, 9: -3.0}])], [record([5, 9, 4])]
    )
    assert (
        not wrong.passed
        and wrong.divergence is not None
        and wrong.divergence.margin > ab.TIE_MARGIN
    )
    outside_top_k = ab.compare(1, stock, [record([5, 8, 4])])
    assert not outside_top_k.passed


def test_every_requests_first_divergence_is_judged() -> None:
    # Request 0 diverges at a near-tie, request 1 later with a confident margin: the
    # near-tie must not hide the wrong answer, whichever request comes first.
    tie = (record([5, 6, 7], tops=[{5: -0.1}, {6: -0.70, 9: -0.72}, {7: -0.2}]), record([5, 9, 7]))
    confident = (
        record([1, 2, 3, 4], tops=[{1: -0.1}, {2: -0.1}, {3: -0.05, 8: -4.0}, {4: -0.1}]),
        record([1, 2, 8, 4]),
    )
    for first, second in ((tie, confident), (confident, tie)):
        result = ab.compare(2, [first[0], second[0]], [first[1], second[1]])
        assert not result.passed and not result.correct
        assert len(result.divergences) == 2
        assert result.divergence is not None and result.divergence.position == 2
        assert result.divergence.margin == pytest.approx(3.95)
    # Every diverging request a near-tie: passes, and each is recorded.
    both_ties = ab.compare(2, [tie[0], tie[0]], [record([5, 9, 7]), record([5, 9, 7])])
    assert both_ties.passed and [d.request for d in both_ties.divergences] == [0, 1]


def test_outputs_of_different_lengths_fail() -> None:
    short = ab.compare(1, [record([5, 6, 7], tops=[{5: -0.1}] * 3)], [record([5, 6])])
    assert not short.passed and short.divergence is not None
    assert short.divergence.margin == float("inf")


def test_a_path_slower_than_the_stock_path_fails_even_with_equal_tokens() -> None:
    stock = [record([5, 6, 7], gap=0.010)]
    slower = ab.compare(1, stock, [record([5, 6, 7], gap=0.011)])
    assert slower.correct and slower.tokens_equal
    assert not slower.not_slower and not slower.passed
    assert ab.compare(1, stock, [record([5, 6, 7], gap=0.010)]).passed  # a tie is not slower
    # A self-check (stock against stock) judges tokens only: neither side is faster.
    assert ab.compare(1, stock, [record([5, 6, 7], gap=0.011)], judge_speed=False).passed


def test_the_passing_range_stops_where_the_path_stops_winning() -> None:
    def at(batch: int, gap: float) -> ab.AbResult:
        return ab.compare(batch, [record([1, 2], gap=0.010)], [record([1, 2], gap=gap)])

    results = [at(1, 0.008), at(4, 0.009), at(16, 0.012), at(64, 0.009)]
    assert ab.passing_range(results) == (1, 4)  # 16 is slower: 64 does not count
    assert ab.passing_range([at(1, 0.02)]) is None


STOCK_BUILT = {"additional_config": {}, "modules": ["vllm.Linear", "vllm.MLAAttention"]}
PATH_BUILT = {
    "additional_config": {"decode_backend": "latency_specialized"},
    "modules": ["vllm.Linear", "vllm.MLAAttention", "vllm.kimi_k3.SpecializedDecode"],
}


def test_backend_proof_needs_the_config_and_modules_the_stock_engine_lacks() -> None:
    proof = ab.backend_proof(STOCK_BUILT, PATH_BUILT)
    assert proof["ran"] and proof["path_only_modules"] == ["vllm.kimi_k3.SpecializedDecode"]
    # The flag reached the engine but nothing else was built: the stock backend ran.
    flag_only = dict(STOCK_BUILT, additional_config=PATH_BUILT["additional_config"])
    assert not ab.backend_proof(STOCK_BUILT, flag_only)["ran"]
    # Modules differ but the flag is missing: not this path.
    assert not ab.backend_proof(STOCK_BUILT, dict(PATH_BUILT, additional_config={}))["ran"]
    # The stock side had the flag too: not an A/B against the stock path.
    assert not ab.backend_proof(PATH_BUILT, PATH_BUILT)["ran"]


def test_ab_evidence_backs_a_scope_only_where_it_ran(tmp_path: Path) -> None:
    results = [ab.compare(b, [record([1, 2])], [record([1, 2])]) for b in (1, 4, 16, 64)]
    engine = {"model_type": "kimi_k3", "tp": 8, "dcp": 8}
    proof = ab.backend_proof(STOCK_BUILT, PATH_BUILT)
    path, md = ab.write(
        tmp_path / "ab",
        arch="sm_103a",
        engine=engine,
        vllm_version="0.33.0",
        fingerprint={},
        results=results,
        backend=proof,
    )
    data = json.loads(path.read_text())
    assert "| 64 | pass | - |" in md.read_text()
    scope = dataclasses.replace(
        KIMI_K3, archs=("sm_103a",), parallel=((8, 8),), max_batch=64, vllm_versions=("0.33.0",)
    )
    entry = ValidatedScope(scope=scope, evidence="ab.json")
    assert covers(entry, data) is None
    wider = ValidatedScope(scope=dataclasses.replace(scope, max_batch=256), evidence="ab.json")
    assert covers(wider, data) == "no passing A/B at batch 256"
    other_vllm = ValidatedScope(
        scope=dataclasses.replace(scope, vllm_versions=("0.34",)), evidence="ab.json"
    )
    assert covers(other_vllm, data) == "vLLM 0.33.0, scope claims ['0.34']"
    # Versions match exactly: 0.33.0 evidence does not cover the 0.33 series.
    series = ValidatedScope(
        scope=dataclasses.replace(scope, vllm_versions=("0.33",)), evidence="ab.json"
    )
    assert covers(series, data) == "vLLM 0.33.0, scope claims ['0.33']"
    # Without proof that the specialised backend ran, the file covers nothing.
    unproven = dict(data, backend=ab.backend_proof(STOCK_BUILT, STOCK_BUILT))
    assert "no proof that the specialised backend ran" in str(covers(entry, unproven))
    # A slower path at one batch size: the scope must end before it.
    slow_64 = ab.compare(64, [record([1, 2], gap=0.01)], [record([1, 2], gap=0.02)])
    slower = dict(data, results=[*data["results"][:3], slow_64.to_json()])
    assert covers(entry, slower) == "no passing A/B at batch 64"
    narrowed = ValidatedScope(scope=dataclasses.replace(scope, max_batch=16), evidence="ab.json")
    assert covers(narrowed, slower) is None
    b200 = ValidatedScope(scope=dataclasses.replace(scope, archs=("sm_100a",)), evidence="ab.json")
    assert "recorded on sm_103a" in str(covers(b200, data))
    self_check, _ = ab.write(
        tmp_path / "self",
        arch="sm_103a",
        engine=engine,
        vllm_version="0.33.0",
        fingerprint={},
        results=results,
        self_check=True,
    )
    assert covers(entry, json.loads(self_check.read_text())) == f"not an A/B of {KIMI_K3.name}"


def test_timing_statistics_are_per_call_medians_with_spread() -> None:
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)
    with pytest.raises(ValueError, match="no samples"):
        quantile([], 0.5)
    # 20 calls per CUDA graph replay: samples are per replay, results per call.
    timing = summarize([200.0, 220.0, 180.0, 210.0, 190.0], calls_per_sample=20, graph=True)
    assert timing.median_us == 10.0 and timing.repeats == 5 and timing.graph
    assert timing.p10_us == pytest.approx(9.2) and timing.p90_us == pytest.approx(10.8)
    assert timing.spread == pytest.approx(0.16)
    assert timing.to_json()["spread"] == 0.16


def test_prompts_are_distinct_and_deterministic() -> None:
    assert ab.prompts(64) == ab.prompts(64)
    assert len(set(ab.prompts(64))) == 64
