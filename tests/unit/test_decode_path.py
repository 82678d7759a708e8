"""The gate's decision, from the config to the engine: engine args, the plugin's re-check,
what each engine reports, ``kvtide inspect`` and the metric.

No GPU anywhere: every shape is built by hand or from a checkpoint ``config.json`` written
here (a Kimi K2 config relabelled ``kimi_k3``, so the Kimi K3 path's rules apply).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest
from kernel_evidence import ab_entry, kernel_entry
from test_kernels_gate import KIMI_K3_GB300

from engines.base import EngineSpec
from engines.decode_path import DecodePath, choose_decode_path
from engines.vllm_engine import VLLMEngine, engine_args_for
from kernels import vllm_plugin
from kernels.gate import KIMI_K3_PATH
from kernels.scope import KIMI_K3
from orchestrator.cli.inspect import format_stats
from orchestrator.config import KVTideConfig, decode_paths, parse_config
from orchestrator.errors import ConfigError
from orchestrator.kv.decider import kv_lifecycle_config
from orchestrator.kv.service import KVService, ServiceSettings
from orchestrator.observability.metrics import Metrics
from orchestrator.serve.responses import pool_stats
from placement.model_catalog import BUILTIN_MODELS

REPO = Path(__file__).resolve().parents[2]

# A Kimi-K3-like engine on B200/GB200 at TP 8, DCP 1: inside vLLM's declared limits.
KIMI_K3_B200_TP8 = dataclasses.replace(KIMI_K3_GB300, gpu_arch="sm_100a", dcp=1, max_batch=256)
KIMI_K3_ON = {"decode_backend": "latency_specialized"}
# Evidence covering that engine, written for the tests (none is checked in).
B200_EVIDENCE = (
    ab_entry(
        dataclasses.replace(
            KIMI_K3,
            archs=("sm_100a",),
            parallel=((8, 1),),
            max_batch=256,
            vllm_versions=("0.33.0",),
        ),
        "ab-sm_100a-tp8-dcp1-x.json",
    ),
)
OPTED_IN = (KIMI_K3_PATH,)


def spec(**overrides: Any) -> EngineSpec:
    fields: dict[str, Any] = {
        "engine_id": "decode-0",
        "role": "decode",
        "model_path": "/m",
        "served_model_name": "m",
        "device": "cuda",
        "dtype": "bfloat16",
        "tensor_parallel_size": 8,
    }
    return EngineSpec(**(fields | overrides))


@pytest.fixture
def kimi_k3_checkpoint(tmp_path: Path) -> Path:
    """A checkpoint directory whose config.json is Kimi K2's with model_type kimi_k3."""
    source = REPO / "placement" / "data" / "hf_configs" / BUILTIN_MODELS["kimi-k2"]
    config = json.loads(source.read_text()) | {"model_type": "kimi_k3"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def gpu_config(model_path: Path, **extra: Any) -> KVTideConfig:
    pool = {"tensor_parallel_size": 8, "cpu_threads_bind": None}
    return parse_config(
        {
            "device": "cuda",
            "model": {"path": str(model_path), "dtype": "bfloat16"},
            "prefill": {"cpu_threads_bind": None},  # TP 1: outside vLLM's Kimi K3 limits
            "decode": pool,
            **extra,
        }
    )


# ---- the decision ---------------------------------------------------------------------


def test_without_evidence_vllms_kimi_k3_path_is_off_even_when_opted_in() -> None:
    path = choose_decode_path(KIMI_K3_B200_TP8, opted_in=OPTED_IN)
    assert path.paths == () and path.name == "stock"
    assert "kimi_k3_latency_specialized: no evidence" in path.reason
    assert "additional_config" not in engine_args_for(spec(decode_path=path))


def test_a_covered_opted_in_kimi_k3_engine_runs_vllms_path_and_records_why() -> None:
    path = choose_decode_path(KIMI_K3_B200_TP8, B200_EVIDENCE, OPTED_IN)
    assert path.paths == (KIMI_K3_PATH,) and path.name == KIMI_K3_PATH
    assert path.reason == (
        "kimi_k3_latency_specialized: opted in, inside a scope validated by "
        "ab-sm_100a-tp8-dcp1-x.json"
    )
    # Not opted in: stock, and the reason says the evidence would allow it.
    assert "not opted in" in choose_decode_path(KIMI_K3_B200_TP8, B200_EVIDENCE).reason
    args = engine_args_for(spec(decode_path=path), B200_EVIDENCE)
    assert args["additional_config"] == KIMI_K3_ON
    # Keys the user set in additional_config are kept beside the path's.
    mine = spec(decode_path=path, extra_engine_args=(("additional_config", {"x": 1}),))
    assert engine_args_for(mine, B200_EVIDENCE)["additional_config"] == {"x": 1, **KIMI_K3_ON}


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"gpu_arch": "sm_90a"}, "arch sm_90a not in ['sm_100a', 'sm_103a']"),
        ({"tp": 4}, "TP 4 / DCP 1 not in (TP, DCP)"),
        ({"dcp": 2}, "TP 8 / DCP 2 not in"),
        ({"ep": 8}, "without pipeline or expert parallelism"),
        ({"model_type": "deepseek_v3"}, "model type 'deepseek_v3' not in"),
        ({"max_batch": 512}, "ab-sm_100a-tp8-dcp1-x.json: batch 512 outside 1..256"),
    ],
)
def test_out_of_scope_engines_run_the_stock_path_with_unchanged_args(
    change: dict[str, Any], why: str
) -> None:
    engine = dataclasses.replace(KIMI_K3_B200_TP8, **change)
    path = choose_decode_path(engine, B200_EVIDENCE, OPTED_IN)
    assert path.paths == () and path.name == "stock"
    assert why in path.reason
    # kvtide's kernels are refused too, for lack of evidence (or of DCP).
    assert "fused_add_rmsnorm: " in path.reason and "no evidence" in path.reason
    assert engine_args_for(spec(decode_path=path)) == engine_args_for(spec())
    assert "additional_config" not in engine_args_for(spec(decode_path=path))


def test_a_kernel_that_passed_the_gate_without_a_vllm_integration_stays_off() -> None:
    from kernels.scope import RMSNORM

    validated = (
        kernel_entry(dataclasses.replace(RMSNORM, archs=("sm_100a",)), "sm_100a-b200.json"),
    )
    engine = dataclasses.replace(KIMI_K3_B200_TP8, tp=4)
    path = choose_decode_path(engine, validated, ("fused_add_rmsnorm",))
    assert path.name == "stock"
    assert "fused_add_rmsnorm: passed the gate but has no vLLM integration yet" in path.reason


# ---- from the config ------------------------------------------------------------------


def test_a_config_opting_in_gets_the_stock_path_without_evidence_and_says_why(
    kimi_k3_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decode_paths, "installed_vllm_version", lambda: "0.33.0")
    cfg = gpu_config(kimi_k3_checkpoint, gpu_arch="sm_100a", specialised_paths=[KIMI_K3_PATH])
    assert cfg.specialised_paths == (KIMI_K3_PATH,)
    decode = cfg.engine_spec(cfg.decode, "decode-0", side_channel_port=5600)
    assert decode.decode_path.name == "stock"
    assert decode.decode_path.engine == dataclasses.replace(
        KIMI_K3_B200_TP8, num_attention_heads=64, max_batch=64
    )
    assert "kimi_k3_latency_specialized: no evidence" in decode.decode_path.reason
    assert "additional_config" not in engine_args_for(decode)
    assert not any(k.startswith("KVTIDE_KERNELS") for k, _ in decode.env)
    # The same engine with evidence: on only where the config opts in.
    assert choose_decode_path(decode.decode_path.engine, B200_EVIDENCE, cfg.specialised_paths).paths
    # The prefill pool (TP 1) is outside vLLM's limits whatever the evidence.
    prefill = cfg.engine_spec(cfg.prefill, "prefill-0", side_channel_port=5601)
    assert "TP 1 / DCP 1 not in (TP, DCP)" in prefill.decode_path.reason
    # The vLLM installed here is not one the path exists in: said so.
    monkeypatch.setattr(decode_paths, "installed_vllm_version", lambda: "0.32.0")
    reason = cfg.engine_spec(cfg.decode, "decode-0", 5600).decode_path.reason
    assert "outside vLLM's limits: vLLM 0.32.0 not in ['0.33']" in reason
    with pytest.raises(ConfigError, match="specialised_paths"):
        gpu_config(kimi_k3_checkpoint, specialised_paths=["fast_decode"])


def test_without_gpu_arch_engine_specs_are_exactly_as_before(kimi_k3_checkpoint: Path) -> None:
    for cfg in (parse_config(None), gpu_config(kimi_k3_checkpoint)):
        for pool in cfg.pools():
            s = cfg.engine_spec(pool, f"{pool.name}-0", side_channel_port=5600)
            assert s.decode_path == DecodePath(reason=s.decode_path.reason)
            assert "the gate is asked only for CUDA engines whose gpu_arch is set" in (
                s.decode_path.reason
            )
            assert "additional_config" not in engine_args_for(s)
            assert not any(k.startswith("KVTIDE_KERNELS") for k, _ in s.env)
            # The idle-step wait is measured on CPU only: GPU engines step as vLLM's.
            assert ("KVTIDE_IDLE_STEP_WAIT_MS" in dict(s.env)) == (cfg.device == "cpu")
    cpu = parse_config(None)
    assert dict(cpu.engine_spec(cpu.decode, "d", 5600).env) == {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "1",
        "KVTIDE_IDLE_STEP_WAIT_MS": "20",
        # server.internal_host is loopback: NIXL's transport stays on the loopback device.
        "UCX_NET_DEVICES": "lo",
    }


def test_gpu_arch_needs_cuda_and_a_known_arch() -> None:
    with pytest.raises(ConfigError, match="gpu_arch: sm_100a needs device: cuda") as err:
        parse_config({"gpu_arch": "sm_100a"})
    assert err.value.field == "gpu_arch"
    with pytest.raises(ConfigError, match="gpu_arch"):
        parse_config({"device": "cuda", "gpu_arch": "sm_80"})


def test_simulated_engines_and_unreadable_checkpoints_run_the_stock_path(tmp_path: Path) -> None:
    cfg = gpu_config(tmp_path / "missing", gpu_arch="sm_100a")
    s = cfg.engine_spec(cfg.decode, "decode-0", side_channel_port=5600)
    assert s.decode_path.name == "stock"
    assert s.decode_path.reason.startswith("cannot read the model's config.json")
    sim = cfg.model_copy(update={"backend": "simulated"})
    reason = sim.engine_spec(sim.decode, "decode-0", 5600).decode_path.reason
    assert reason == "simulated engine: it runs no GPU kernels"


# ---- the engine's re-check ------------------------------------------------------------


def test_engine_args_asking_for_the_kimi_backend_outside_the_decision_are_refused() -> None:
    # Slipped in through extra engine args on an engine the gate did not allow it on.
    sneaked = spec(extra_engine_args=(("additional_config", KIMI_K3_ON),))
    with pytest.raises(vllm_plugin.KernelGateRefused, match="decode path is stock"):
        engine_args_for(sneaked)
    # A decision claiming the path for a shape outside vLLM's limits (Hopper).
    hopper = dataclasses.replace(KIMI_K3_B200_TP8, gpu_arch="sm_90a")
    claimed = DecodePath(paths=(KIMI_K3_PATH,), reason="claimed", engine=hopper)
    with pytest.raises(vllm_plugin.KernelGateRefused, match="arch sm_90a not in"):
        engine_args_for(spec(decode_path=claimed), B200_EVIDENCE)
    # A decision for a covered engine, but no evidence checked in: refused at start.
    covered = DecodePath(paths=(KIMI_K3_PATH,), reason="claimed", engine=KIMI_K3_B200_TP8)
    with pytest.raises(vllm_plugin.KernelGateRefused, match="no evidence"):
        engine_args_for(spec(decode_path=covered))


def test_an_engine_refuses_to_start_on_a_decision_that_does_not_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVTIDE_KERNELS", raising=False)
    tp4 = dataclasses.replace(KIMI_K3_B200_TP8, tp=4)
    engine = VLLMEngine(
        spec(
            decode_path=DecodePath(paths=(KIMI_K3_PATH,), reason="claimed", engine=tp4),
            env=(("KVTIDE_KERNELS", KIMI_K3_PATH),),
        )
    )
    with pytest.raises(vllm_plugin.KernelGateRefused, match="TP 4 / DCP 1 not in"):
        asyncio.run(engine.start())
    # Refused before anything else: the engine's environment was not applied.
    assert "KVTIDE_KERNELS" not in os.environ


# ---- what the engine reports, inspect, the metric -------------------------------------


def _book(engine_id: str, path: DecodePath) -> dict[str, Any]:
    stats = VLLMEngine(spec(engine_id=engine_id, decode_path=path)).stats()
    book: dict[str, Any] = msgspec.to_builtins(stats)
    return book


def test_each_engine_reports_its_decode_path_and_the_pool_counts_them() -> None:
    kimi = choose_decode_path(KIMI_K3_B200_TP8, B200_EVIDENCE, OPTED_IN)
    stock = choose_decode_path(dataclasses.replace(KIMI_K3_B200_TP8, tp=4), B200_EVIDENCE, OPTED_IN)
    book = _book("decode-a", kimi)
    assert book["decode_path"] == KIMI_K3_PATH and book["decode_path_reason"] == kimi.reason
    merged = pool_stats("decode", [book, _book("decode-b", stock), _book("decode-c", kimi)])
    assert merged["decode_paths"] == {KIMI_K3_PATH: 2, "stock": 1}
    assert "decode_path" not in merged and "decode_path_reason" not in merged


def test_inspect_stats_shows_each_engines_decode_path_and_reason() -> None:
    kimi = choose_decode_path(KIMI_K3_B200_TP8, B200_EVIDENCE, OPTED_IN)
    books = {"decode-a": _book("decode-a", kimi), "prefill-a": _book("prefill-a", DecodePath())}
    body = {
        "engines": {"decode": pool_stats("decode", [books["decode-a"]])},
        "engine_replicas": books,
    }
    lines = format_stats(body).splitlines()
    assert "    decode paths: kimi_k3_latency_specialized 1" in lines
    at = lines.index("Decode path of each engine (kernels.gate's decision and reason):")
    assert lines[at + 1 : at + 3] == [
        f"  decode-a: kimi_k3_latency_specialized ({kimi.reason})",
        "  prefill-a: stock (no specialised decode path was asked for)",
    ]


def test_engines_are_counted_by_decode_path_per_pool_in_the_metric() -> None:
    config = kv_lifecycle_config(
        ttl_s=480,
        safety_margin_s=15,
        recompute_threshold_tokens=64,
        kv_bytes_per_token=100,
        block_size_tokens=16,
    )
    service = KVService(
        config,
        prefill=None,
        settings=ServiceSettings(drain_timeout_s=1.0),
    )
    kimi = choose_decode_path(KIMI_K3_B200_TP8, B200_EVIDENCE, OPTED_IN)

    async def beat(engine_id: str, path: DecodePath) -> None:
        await service.heartbeat(engine_id, (), _book(engine_id, path))

    async def story() -> None:
        await beat("decode-a", kimi)
        await beat("decode-b", kimi)
        await beat("prefill-a", DecodePath())

    asyncio.run(story())
    counts = service.engines_by_decode_path()
    assert counts == {"decode": {KIMI_K3_PATH: 2}, "prefill": {"stock": 1}}
    metrics = Metrics()
    metrics.set_engines_by_decode_path(counts)
    key = 'kvtide_engines_by_decode_path{pool="%s",path="%s"}'
    assert metrics.snapshot()[key % ("decode", KIMI_K3_PATH)] == 2.0
    assert metrics.snapshot()[key % ("prefill", "stock")] == 1.0
    # The decode engines are lost: their series read 0, not their last count.
    asyncio.run(service.engines_lost(["decode-a", "decode-b"]))
    metrics.set_engines_by_decode_path(service.engines_by_decode_path())
    assert metrics.snapshot()[key % ("decode", KIMI_K3_PATH)] == 0.0
    assert metrics.snapshot()[key % ("prefill", "stock")] == 1.0
