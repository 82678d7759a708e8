"""The gate decides, per engine, which specialised decode paths it may use, and says why.

Story: a Kimi K3 engine on GB300 at TP 8 / DCP 8 is inside vLLM's limits for its
latency-specialised path and in the norm kernel's scope, but no GPU evidence is checked
in, so both are off whatever the config asks. Once a validated scope is checked in (here
hand-made ones) a path is on only inside that scope, only from today's sources and only
where the config opts in. The vLLM plugin hook is inert until asked, and refuses what the
gate refuses.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from fresh_python import printed_by_fresh_python
from kernel_evidence import ab_entry, kernel_entry

from kernels import gate, scope, vllm_plugin
from kernels.gate import EngineShape, decide, decision_for

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
    vllm_version="0.33.0",
)
# What an A/B on GB300 at TP 8 / DCP 8, batch 1-64, vLLM 0.33.0 would validate.
KIMI_K3_GB300_EVIDENCE = ab_entry(
    dataclasses.replace(
        scope.KIMI_K3,
        archs=("sm_103a",),
        parallel=((8, 8),),
        max_batch=64,
        vllm_versions=("0.33.0",),
    ),
    "ab-sm_103a-tp8-dcp8-x.json",
)
KIMI = gate.KIMI_K3_PATH


def test_scope_and_gate_import_without_torch() -> None:
    code = (
        "import sys, kernels.scope, kernels.gate, kernels.vllm_plugin; "
        "print('torch' in sys.modules, 'cutlass' in sys.modules)"
    )
    assert printed_by_fresh_python(code) == ["False", "False"]


def test_public_names_are_pinned() -> None:
    assert gate.PATHS == ("fused_add_rmsnorm", "kimi_k3_latency_specialized")
    assert sorted(scope.__all__) == sorted(
        [
            "ALL_ARCHS",
            "KIMI_K3",
            "ODD_BATCHES",
            "RMSNORM",
            "SCOPES",
            "AbCase",
            "AddRmsNormScope",
            "KernelScope",
            "RmsNormCase",
            "ValidationCase",
            "Variant",
            "VllmPathScope",
            "arch_from_capability",
            "scope_named",
            "version_matches",
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


def test_cases_cover_odd_token_counts_and_the_largest_in_scope_shape() -> None:
    cases = scope.RMSNORM.cases()
    assert len({c.case_id for c in cases}) == len(cases)
    assert {c.batch for c in cases} == {1, 3, 77, 64, 1024}
    assert "fused_add_rmsnorm/b1024-h8192-bf16-fp8_e4m3" in {c.case_id for c in cases}
    # vLLM's path is measured at both ends of its batch range and between.
    assert [c.batch for c in scope.KIMI_K3.cases()] == [1, 4, 16, 64, 256, 1024]
    assert [c.batch for c in KIMI_K3_GB300_EVIDENCE.scope.cases()] == [1, 4, 16, 64]


def test_without_evidence_every_path_is_off_even_when_the_config_opts_in() -> None:
    assert gate.VALIDATED == ()
    for opted_in in ((), gate.PATHS):
        rmsnorm, kimi = decide(KIMI_K3_GB300, opted_in=opted_in)
        assert not rmsnorm.enabled and rmsnorm.reason.startswith("no evidence")
        assert not kimi.enabled and kimi.reason.startswith("no evidence")


def test_vllms_path_is_on_only_inside_its_evidence_and_only_when_opted_in() -> None:
    validated = (KIMI_K3_GB300_EVIDENCE,)
    on = decision_for(KIMI, KIMI_K3_GB300, validated, opted_in=[KIMI])
    assert on.enabled and on.evidence == "ab-sm_103a-tp8-dcp8-x.json"
    off = decision_for(KIMI, KIMI_K3_GB300, validated)
    assert not off.enabled and off.reason.startswith(
        "not opted in: ab-sm_103a-tp8-dcp8-x.json covers this engine"
    )
    # Inside vLLM's limits, outside what the A/B covered: arch, TP/DCP, batch, version.
    misses = {
        "gpu_arch": ("sm_100a", "arch sm_100a not in ['sm_103a']"),
        "dcp": (1, "TP 8 / DCP 1 not in (TP, DCP) [(8, 8)]"),
        "max_batch": (256, "batch 256 outside 1..64"),
        "vllm_version": ("0.33.1", "vLLM 0.33.1 not in ['0.33.0']"),
    }
    for field, (value, why) in misses.items():
        engine = dataclasses.replace(KIMI_K3_GB300, **{field: value})  # type: ignore[arg-type]
        decision = decision_for(KIMI, engine, validated, opted_in=[KIMI])
        assert not decision.enabled
        assert (
            decision.reason == f"no evidence covers this engine (ab-sm_103a-tp8-dcp8-x.json: {why})"
        )


def test_kernel_evidence_from_other_sources_is_stale_and_covers_nothing() -> None:
    narrowed = dataclasses.replace(scope.RMSNORM, archs=("sm_103a",), max_batch=64)
    fresh = kernel_entry(narrowed, "k.json")
    today = fresh.source_sha256
    assert today is not None
    assert decision_for("fused_add_rmsnorm", KIMI_K3_GB300, (fresh,), ["fused_add_rmsnorm"]).enabled
    stale = decision_for(
        "fused_add_rmsnorm", KIMI_K3_GB300, (fresh,), ["fused_add_rmsnorm"], "b" * 64
    )
    assert not stale.enabled
    assert stale.reason == (
        f"stale evidence: k.json was made from kernel sources {today[:12]}, "
        "these are bbbbbbbbbbbb (validate again)"
    )
    # An entry naming other sources than its file: the file check refuses it too.
    other = dataclasses.replace(fresh, source_sha256="a" * 64)
    refused = decision_for(
        "fused_add_rmsnorm", KIMI_K3_GB300, (other,), ["fused_add_rmsnorm"], "a" * 64
    )
    assert refused.reason.startswith("evidence does not back the scope (k.json: ")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"gpu_arch": "sm_80a"}, "outside the kernel's scope: arch sm_80a not in"),
        ({"dtype": "fp32"}, "outside the kernel's scope: dtype fp32 not in"),
        ({"hidden_size": 2048}, "outside the kernel's scope: hidden size 2048 not in"),
        ({"max_batch": 2000}, "outside the kernel's scope: batch 2000 outside 1..1024"),
    ],
)
def test_rmsnorm_refusals_name_the_offending_value(change: dict[str, object], reason: str) -> None:
    engine = dataclasses.replace(KIMI_K3_GB300, **change)  # type: ignore[arg-type]
    assert decision_for("fused_add_rmsnorm", engine).reason.startswith(reason)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"model_type": "deepseek_v3"}, "model type 'deepseek_v3' not in ['kimi_k3']"),
        ({"gpu_arch": "sm_90a"}, "arch sm_90a not in ['sm_100a', 'sm_103a']"),
        ({"tp": 4, "dcp": 4}, "TP 4 / DCP 4 not in (TP, DCP)"),
        ({"dcp": 4}, "TP 8 / DCP 4 not in (TP, DCP)"),
        ({"pp": 2}, "PP 2 / EP 1: the path runs without pipeline or expert parallelism"),
        ({"ep": 8}, "PP 1 / EP 8: the path runs without pipeline or expert parallelism"),
        ({"max_batch": 2048}, "batch 2048 outside 1..1024"),
        ({"vllm_version": None}, "vLLM version unknown"),
        ({"vllm_version": "0.32.0"}, "vLLM 0.32.0 not in ['0.33']"),
    ],
)
def test_kimi_k3_path_follows_vllms_limits(change: dict[str, object], reason: str) -> None:
    engine = dataclasses.replace(KIMI_K3_GB300, **change)  # type: ignore[arg-type]
    decision = decision_for(KIMI, engine, (KIMI_K3_GB300_EVIDENCE,), [KIMI])
    assert not decision.enabled
    assert decision.reason.startswith(f"outside vLLM's limits: {reason}")


@pytest.mark.parametrize(("tp", "dcp"), [(8, 1), (16, 16), (16, 1)])
def test_kimi_k3_path_accepts_tp_8_or_16_with_dcp_1_or_tp(tp: int, dcp: int) -> None:
    engine = dataclasses.replace(KIMI_K3_GB300, gpu_arch="sm_100a", tp=tp, dcp=dcp)
    narrowed = dataclasses.replace(
        scope.KIMI_K3, archs=("sm_100a",), parallel=((tp, dcp),), vllm_versions=("0.33.0",)
    )
    evidence = ab_entry(narrowed, f"ab-tp{tp}-dcp{dcp}.json")
    assert decision_for(KIMI, engine, (evidence,), [KIMI]).enabled
    assert not scope.version_matches("0.330", ("0.33",))


def no_gpu() -> None:
    """This process's GPU arch, as the plugin asks for it: none here."""
    return None


def test_plugin_is_inert_without_its_variable() -> None:
    vllm_plugin.register({})
    vllm_plugin.register({"KVTIDE_KERNELS": " , "})


EVIDENCE = (KIMI_K3_GB300_EVIDENCE,)


def on_gb300() -> str:
    return "sm_103a"


def vllm_0330() -> str:
    return "0.33.0"


def test_plugin_refuses_a_path_the_gate_refuses() -> None:
    with pytest.raises(
        vllm_plugin.KernelGateRefused, match=r"kimi_k3_latency_specialized refused.*no evidence"
    ):
        vllm_plugin.engine_settings(KIMI_K3_GB300, [KIMI])
    settings = vllm_plugin.engine_settings(KIMI_K3_GB300, [KIMI], EVIDENCE)
    assert settings.additional_config == {"decode_backend": "latency_specialized"}
    vllm_plugin.register(settings.env, on_gb300, vllm_0330, EVIDENCE)
    # Without checked-in evidence the same settings stop the engine at start.
    with pytest.raises(vllm_plugin.KernelGateRefused, match="no evidence"):
        vllm_plugin.register(settings.env, on_gb300, vllm_0330)
    # The same settings on an engine that drifted to PP 2 stop the engine at start.
    drifted = json.loads(settings.env["KVTIDE_KERNELS_ENGINE"]) | {"pp": 2}
    env = settings.env | {"KVTIDE_KERNELS_ENGINE": json.dumps(drifted)}
    with pytest.raises(vllm_plugin.KernelGateRefused, match="pipeline or expert parallelism"):
        vllm_plugin.register(env, on_gb300, vllm_0330, EVIDENCE)


def test_plugin_names_bad_settings_and_a_different_gpu_or_vllm() -> None:
    settings = vllm_plugin.engine_settings(KIMI_K3_GB300, [KIMI], EVIDENCE)
    # Declared GB300, but the process landed on a B200: refused before anything runs.
    with pytest.raises(vllm_plugin.KernelGateRefused, match=r"declares sm_103a but .* is sm_100a"):
        vllm_plugin.register(settings.env, lambda: "sm_100a", vllm_0330, EVIDENCE)
    # The evidence was for vLLM 0.33.0; this process runs another vLLM.
    with pytest.raises(vllm_plugin.KernelGateRefused, match=r"declares vLLM 0.33.0 but .* 0.34.0"):
        vllm_plugin.register(settings.env, on_gb300, lambda: "0.34.0", EVIDENCE)
    with pytest.raises(vllm_plugin.KernelGateRefused, match="KVTIDE_KERNELS_ENGINE is not:"):
        vllm_plugin.register({"KVTIDE_KERNELS": KIMI})
    with pytest.raises(vllm_plugin.KernelGateRefused, match="not a valid engine shape"):
        vllm_plugin.register(settings.env | {"KVTIDE_KERNELS_ENGINE": "{"}, no_gpu)
    with pytest.raises(vllm_plugin.KernelGateRefused, match="unknown path 'fast_decode'"):
        vllm_plugin.register(settings.env | {"KVTIDE_KERNELS": "fast_decode"}, no_gpu, vllm_0330)
    bad = settings.env | {"KVTIDE_KERNELS_ENGINE": '{"gpu_arch": "sm_103a", "colour": 1}'}
    with pytest.raises(vllm_plugin.KernelGateRefused, match=r"unknown fields \['colour'\]"):
        vllm_plugin.register(bad, no_gpu)


def test_additional_config_for_the_kimi_path_is_checked_against_the_engine() -> None:
    config = {"decode_backend": "latency_specialized"}
    vllm_plugin.check_additional_config(config, KIMI_K3_GB300, EVIDENCE)
    vllm_plugin.check_additional_config({}, dataclasses.replace(KIMI_K3_GB300, tp=2))
    with pytest.raises(vllm_plugin.KernelGateRefused, match="TP 2 / DCP 8 not in"):
        vllm_plugin.check_additional_config(config, dataclasses.replace(KIMI_K3_GB300, tp=2))
    with pytest.raises(vllm_plugin.KernelGateRefused, match="no evidence"):
        vllm_plugin.check_additional_config(config, KIMI_K3_GB300)
