"""The gate decides, per engine, which specialised decode paths it may use, and says why.

Story: a Kimi K3 engine on GB300 at TP 8 / DCP 8 may use vLLM's own latency-specialised
path; kvtide's kernels are in scope for it but refused for lack of GPU evidence; once a
validated scope is checked in (here a hand-made one) the combine is enabled inside that
scope only. The vLLM plugin hook is inert until asked, and refuses what the gate refuses.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from fresh_python import printed_by_fresh_python

from kernels import gate, scope, vllm_plugin
from kernels.gate import EngineShape, ValidatedScope, decide, decision_for

KIMI_K3_GB300 = EngineShape(
    gpu_arch="sm_103a",
    model_type="kimi_k3",
    dtype="bf16",
    hidden_size=7168,
    num_attention_heads=64,
    attention_head_dim=512,
    tp=8,
    dcp=8,
    max_batch=64,
)


def test_scope_and_gate_import_without_torch() -> None:
    code = (
        "import sys, kernels.scope, kernels.gate, kernels.vllm_plugin; "
        "print('torch' in sys.modules, 'cutlass' in sys.modules)"
    )
    assert printed_by_fresh_python(code) == ["False", "False"]


def test_public_names_are_pinned() -> None:
    assert gate.PATHS == ("dcp_lse_combine", "fused_add_rmsnorm", "kimi_k3_latency_specialized")
    assert sorted(scope.__all__) == sorted(
        [
            "ALL_ARCHS",
            "COMBINE",
            "RMSNORM",
            "SCOPES",
            "AddRmsNormScope",
            "CombineCase",
            "KernelScope",
            "LseCombineScope",
            "RmsNormCase",
            "ValidationCase",
            "Variant",
            "arch_from_capability",
            "scope_named",
        ]
    )
    assert sorted(gate.__all__) == sorted(
        [
            "KIMI_K3_ADDITIONAL_CONFIG",
            "KIMI_K3_PATH",
            "PATHS",
            "VALIDATED",
            "EngineShape",
            "PathDecision",
            "ValidatedScope",
            "decide",
            "decision_for",
        ]
    )
    assert scope.arch_from_capability(9, 0) == "sm_90a"
    assert scope.arch_from_capability(10, 3) == "sm_103a"


def test_cases_cover_every_rank_count_head_dim_and_empty_shard_layout() -> None:
    cases = scope.COMBINE.cases()
    assert {c.num_ranks for c in cases} == {2, 4, 8, 16}
    assert {c.head_dim for c in cases} == {128, 512}
    assert {c.shards for c in cases} == {"full", "empty_rank", "short_seq", "all_empty"}
    assert len({c.case_id for c in scope.RMSNORM.cases()}) == len(scope.RMSNORM.cases())
    assert "dcp_lse_combine/n8-b1-h16-d512-bf16-full" in {c.case_id for c in cases}


def test_nothing_is_validated_yet_so_kvtide_kernels_are_refused_for_no_evidence() -> None:
    assert gate.VALIDATED == ()
    combine, rmsnorm, kimi = decide(KIMI_K3_GB300)
    assert not combine.enabled and combine.reason.startswith("no evidence")
    assert not rmsnorm.enabled and rmsnorm.reason.startswith("no evidence")
    assert kimi.enabled and "SM100/SM103" in kimi.reason


def test_evidence_enables_the_combine_only_inside_the_validated_scope() -> None:
    gb300_dcp8 = dataclasses.replace(
        scope.COMBINE, archs=("sm_103a",), num_ranks=(8,), head_dims=(512,), max_batch=128
    )
    validated = (ValidatedScope(scope=gb300_dcp8, evidence="sm_103a-gb300-x.json"),)
    decision = decision_for("dcp_lse_combine", KIMI_K3_GB300, validated)
    assert decision.enabled and decision.evidence == "sm_103a-gb300-x.json"
    # The same engine with a bigger batch is in the kernel's scope but not the evidence's.
    bigger = dataclasses.replace(KIMI_K3_GB300, max_batch=256)
    decision = decision_for("dcp_lse_combine", bigger, validated)
    assert not decision.enabled
    assert decision.reason == (
        "no evidence covers this engine (sm_103a-gb300-x.json: batch 256 outside 1..128)"
    )
    # The norm has no evidence at all.
    assert decision_for("fused_add_rmsnorm", KIMI_K3_GB300, validated).reason.startswith(
        "no evidence"
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"dcp": 1}, "DCP is 1: nothing to combine"),
        ({"gpu_arch": "sm_80a"}, "outside the kernel's scope: arch sm_80a not in"),
        ({"dtype": "fp32"}, "outside the kernel's scope: dtype fp32 not in"),
        ({"attention_head_dim": 256}, "outside the kernel's scope: head dim 256 not in"),
        ({"dcp": 3}, "outside the kernel's scope: 3 DCP ranks not in"),
        ({"max_batch": 1000}, "outside the kernel's scope: batch 1000 outside 1..256"),
    ],
)
def test_combine_refusals_name_the_offending_value(change: dict[str, object], reason: str) -> None:
    engine = dataclasses.replace(KIMI_K3_GB300, **change)  # type: ignore[arg-type]
    assert decision_for("dcp_lse_combine", engine).reason.startswith(reason)


def test_rmsnorm_refuses_hidden_sizes_outside_its_scope() -> None:
    engine = dataclasses.replace(KIMI_K3_GB300, hidden_size=2048)
    decision = decision_for("fused_add_rmsnorm", engine)
    assert decision.reason.startswith("outside the kernel's scope: hidden size 2048 not in")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"model_type": "deepseek_v3"}, "model type 'deepseek_v3' is not Kimi K3"),
        ({"gpu_arch": "sm_90a"}, "arch sm_90a: vLLM's Kimi K3 path runs only on SM100/SM103"),
        ({"tp": 4, "dcp": 4}, "TP 4: vLLM's Kimi K3 path needs TP 8 or 16"),
        ({"dcp": 4}, "DCP 4: vLLM's Kimi K3 path needs DCP 1 or DCP = TP (8)"),
        ({"pp": 2}, "PP 2: vLLM's Kimi K3 path refuses pipeline parallelism"),
        ({"ep": 8}, "EP 8: vLLM's Kimi K3 path refuses expert parallelism"),
    ],
)
def test_kimi_k3_path_follows_vllms_limits(change: dict[str, object], reason: str) -> None:
    engine = dataclasses.replace(KIMI_K3_GB300, **change)  # type: ignore[arg-type]
    decision = decision_for(gate.KIMI_K3_PATH, engine)
    assert not decision.enabled and decision.reason == reason


@pytest.mark.parametrize(("tp", "dcp"), [(8, 1), (16, 16), (16, 1)])
def test_kimi_k3_path_accepts_tp_8_or_16_with_dcp_1_or_tp(tp: int, dcp: int) -> None:
    engine = dataclasses.replace(KIMI_K3_GB300, gpu_arch="sm_100a", tp=tp, dcp=dcp)
    assert decision_for(gate.KIMI_K3_PATH, engine).enabled


def no_gpu() -> None:
    """This process's GPU arch, as the plugin asks for it: none here."""
    return None


def test_plugin_is_inert_without_its_variable() -> None:
    vllm_plugin.register({})
    vllm_plugin.register({"KVTIDE_KERNELS": " , "})


def test_plugin_refuses_a_path_the_gate_refuses() -> None:
    settings = vllm_plugin.engine_settings(KIMI_K3_GB300, [gate.KIMI_K3_PATH])
    assert settings.additional_config == {"decode_backend": "latency_specialized"}
    # The same settings on an engine that drifted to PP 2 stop the engine at start.
    drifted = json.loads(settings.env["KVTIDE_KERNELS_ENGINE"]) | {"pp": 2}
    env = settings.env | {"KVTIDE_KERNELS_ENGINE": json.dumps(drifted)}
    with pytest.raises(vllm_plugin.KernelGateRefused, match="refuses pipeline parallelism"):
        vllm_plugin.register(env, local_arch=lambda: "sm_103a")
    with pytest.raises(
        vllm_plugin.KernelGateRefused, match=r"dcp_lse_combine refused.*no evidence"
    ):
        vllm_plugin.engine_settings(KIMI_K3_GB300, ["dcp_lse_combine"])


def test_plugin_accepts_the_kimi_path_and_names_bad_settings() -> None:
    settings = vllm_plugin.engine_settings(KIMI_K3_GB300, [gate.KIMI_K3_PATH])
    vllm_plugin.register(settings.env, local_arch=lambda: "sm_103a")
    # Declared GB300, but the process landed on a B200: refused before anything runs.
    with pytest.raises(vllm_plugin.KernelGateRefused, match=r"declares sm_103a but .* is sm_100a"):
        vllm_plugin.register(settings.env, local_arch=lambda: "sm_100a")
    with pytest.raises(vllm_plugin.KernelGateRefused, match="KVTIDE_KERNELS_ENGINE is not:"):
        vllm_plugin.register({"KVTIDE_KERNELS": gate.KIMI_K3_PATH})
    with pytest.raises(vllm_plugin.KernelGateRefused, match="not a valid engine shape"):
        vllm_plugin.register(settings.env | {"KVTIDE_KERNELS_ENGINE": "{"}, no_gpu)
    with pytest.raises(vllm_plugin.KernelGateRefused, match="unknown path 'fast_decode'"):
        vllm_plugin.register(settings.env | {"KVTIDE_KERNELS": "fast_decode"}, no_gpu)
    bad = settings.env | {"KVTIDE_KERNELS_ENGINE": '{"gpu_arch": "sm_103a", "colour": 1}'}
    with pytest.raises(vllm_plugin.KernelGateRefused, match=r"unknown fields \['colour'\]"):
        vllm_plugin.register(bad, no_gpu)


def test_additional_config_for_the_kimi_path_is_checked_against_the_engine() -> None:
    config = {"decode_backend": "latency_specialized"}
    vllm_plugin.check_additional_config(config, KIMI_K3_GB300)
    vllm_plugin.check_additional_config({}, dataclasses.replace(KIMI_K3_GB300, tp=2))
    with pytest.raises(vllm_plugin.KernelGateRefused, match="needs TP 8 or 16"):
        vllm_plugin.check_additional_config(config, dataclasses.replace(KIMI_K3_GB300, tp=2))
