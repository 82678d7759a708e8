"""The validation harness, its evidence files and the CLI, exercised on CPU.

The harness takes the implementation under test as an argument: here the references
themselves (which must pass every case they are given) and a combine that forgets that
empty ranks report garbage (which must fail exactly the empty-shard cases). On a GPU the
gpu-tier test runs ``validate`` for real and writes an evidence file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from kernels import cli, evidence, reference, validate
from kernels.scope import COMBINE, RMSNORM, CombineCase, RmsNormCase

CPU = torch.device("cpu")
SMALL_COMBINE = [
    CombineCase(num_ranks=n, batch=2, num_heads=4, head_dim=d, dtype="bf16", shards=s)
    for n, d in ((2, 128), (8, 512))
    for s in ("full", "empty_rank", "short_seq", "all_empty")
] + [CombineCase(num_ranks=4, batch=3, num_heads=2, head_dim=128, dtype="fp16")]
SMALL_NORM = [
    RmsNormCase(batch=2, hidden_size=4096, dtype="bf16", out_dtype=out)
    for out in ("bf16", "fp8_e4m3")
]


class NaiveCombine(validate.ReferenceImpl):
    """A combine that trusts every rank: exp(lse - max) over all of them, NaN and all."""

    def lse_combine(
        self, partials: torch.Tensor, lses: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = lses.amax(0)
        w = torch.exp(lses - m)
        out = (partials.float() * w[..., None]).sum(0) / w.sum(0)[..., None]
        return out.to(partials.dtype), m + torch.log(w.sum(0))


class NormWithoutResidual(validate.ReferenceImpl):
    def fused_add_rmsnorm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        scale: torch.Tensor | None = None,
        inplace: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, _ = reference.fused_add_rmsnorm(x, torch.zeros_like(residual), weight, eps, scale)
        return normed, (x.float() + residual.float()).to(x.dtype)


def test_the_references_pass_every_case_they_are_given() -> None:
    results = validate.run_cases(SMALL_COMBINE + SMALL_NORM, validate.ReferenceImpl(), CPU)
    assert [r.detail for r in results] == ["ok"] * len(results)
    assert all(r.kernel_us is None for r in results), "no timing without a GPU"


def test_a_combine_that_trusts_empty_ranks_fails_exactly_the_empty_shard_cases() -> None:
    results = validate.run_cases(SMALL_COMBINE, NaiveCombine(), CPU)
    failed = {r.case_id.rsplit("-", 1)[-1] for r in results if not r.passed}
    passed = {r.case_id.rsplit("-", 1)[-1] for r in results if r.passed}
    assert failed == {"empty_rank", "short_seq", "all_empty"}
    assert passed == {"full"}
    assert any("output vs reference combine" in r.detail for r in results if not r.passed)


def test_a_norm_that_drops_the_residual_fails_with_the_check_named() -> None:
    results = validate.run_cases(SMALL_NORM, NormWithoutResidual(), CPU)
    assert [r.detail for r in results] == ["failed: normed vs reference"] * 2


def test_every_case_in_scope_is_listed_once() -> None:
    ids = [c.case_id for c in validate.all_cases()]
    assert len(ids) == len(set(ids)) == len(COMBINE.cases()) + len(RMSNORM.cases())


def _fake_results(timing: float, fail: str | None = None) -> list[validate.CaseResult]:
    return [
        validate.CaseResult(
            case_id=c.case_id,
            kernel=c.kernel,
            passed=c.case_id != fail,
            max_abs_err=0.001,
            detail="ok" if c.case_id != fail else "failed: lse vs reference combine",
            kernel_us=timing,
            stock_us=40.0,
        )
        for c in COMBINE.cases()
    ]


FINGERPRINT = {"gpu": {"name": "NVIDIA H200"}, "driver": "570.1", "git_commit": "abc"}


def test_evidence_round_trip_show_and_diff(tmp_path: Path) -> None:
    first = COMBINE.cases()[0].case_id
    a, md = evidence.write(tmp_path / "a", "sm_90a", _fake_results(10.0), {"x": 1}, FINGERPRINT)
    b, _ = evidence.write(
        tmp_path / "b",
        "sm_90a",
        _fake_results(12.0, fail=first),
        {"x": 1},
        FINGERPRINT | {"driver": "575.2"},
    )
    data = evidence.load(a)
    assert data["summary"] == {"passed": len(COMBINE.cases()), "failed": 0}
    assert "| 10.0 | 40.0 | 4.00x |" in md.read_text()

    shown = evidence.show(tmp_path)
    n = len(COMBINE.cases())
    assert f"sm_90a   all: {n}/{n} cases pass in a.json" in shown
    assert "sm_100a  unvalidated" in shown
    assert "enabled by the gate: nowhere (no evidence)" in shown
    listed = evidence.show(tmp_path, cases=True)
    assert f"    {first}  a.json" in listed
    assert f"    {RMSNORM.cases()[0].case_id}  unvalidated" in listed

    changes = evidence.diff(a, b)
    assert "fingerprint.driver: 570.1 -> 575.2" in changes
    assert f"{first}: pass -> FAIL (failed: lse vs reference combine)" in changes
    assert "kernel 10.0 -> 12.0 µs (+20%)" in changes
    with pytest.raises(ValueError, match="not a kvtide kernel evidence file"):
        (tmp_path / "c.json").write_text(json.dumps({"format": 9}))
        evidence.load(tmp_path / "c.json")


def test_nothing_has_evidence_in_the_repository_yet() -> None:
    shown = evidence.show()
    assert shown.count("unvalidated") == 6  # 2 kernels x 3 archs
    assert not list(evidence.EVIDENCE_DIR.glob("*.json"))


def test_cli_mounts_under_a_parent_parser(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="kvtide")
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["kernels", "show"])
    assert args.func(args) == 0
    assert "dcp_lse_combine" in capsys.readouterr().out
    args = parser.parse_args(["kernels"])
    assert args.func(args) == 2


def test_cli_validate_without_a_gpu(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the gpu tier covers validate")
    assert cli.main(["validate"]) == 2
    assert "validate needs one" in capsys.readouterr().err
    argv = ["validate", "--dry-run", "--kernel", "fused_add_rmsnorm", "--max-batch", "1"]
    assert cli.main([*argv, "--out", str(tmp_path / "dry")]) == 0
    assert "dry run: 10 passed, 0 failed" in capsys.readouterr().out
    assert evidence.load(tmp_path / "dry.json")["arch"] == "cpu"


@pytest.mark.gpu
def test_validate_on_this_gpu_writes_passing_evidence(tmp_path: Path) -> None:
    assert cli.main(["validate", "--out", str(tmp_path / "ev")]) == 0
    data = evidence.load(tmp_path / "ev.json")
    assert data["summary"]["failed"] == 0
    assert all(r["kernel_us"] and r["stock_us"] for r in data["results"])


def test_every_validated_scope_is_covered_by_its_evidence_file() -> None:
    # Empty until a GPU run is checked in; then each entry must name a file that passed
    # every case of its (narrowed) scope on each arch it claims.
    from kernels.gate import VALIDATED

    for entry in VALIDATED:
        data = evidence.load(evidence.EVIDENCE_DIR / entry.evidence)
        assert entry.scope.archs == (data["arch"],), entry.evidence
        passed = {r["case_id"] for r in data["results"] if r["passed"]}
        missing = [c.case_id for c in entry.scope.cases() if c.case_id not in passed]
        assert not missing, f"{entry.evidence} lacks passing {missing[:3]}"
