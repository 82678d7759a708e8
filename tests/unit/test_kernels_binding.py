"""Evidence is bound to everything it covers: change any of it and the scope turns off.

A kernel evidence file records the kernel sources, the harness and launcher, the launch
settings of its arch's kernels and the sha256 of every cubin and PTX file of that arch
(``kernels.sources``); an A/B records the exact vLLM version. The gate loads the file on
every decision (``kernels.coverage.check_file``), so each tamper below turns an enabled
path off, with the reason, on the gate's own decision.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from kernel_evidence import ab_entry, kernel_entry
from test_kernels_gate import KIMI_K3_GB300

from kernels import evidence, scope, sources
from kernels.gate import ValidatedScope, decision_for
from kernels.scope import ALL_ARCHS

NORM = scope.RMSNORM.name


def norm_on(arch: str, entry: ValidatedScope) -> tuple[bool, str]:
    engine = dataclasses.replace(KIMI_K3_GB300, gpu_arch=arch)
    decision = decision_for(NORM, engine, (entry,), [NORM])
    return decision.enabled, decision.reason


def shipped_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of kernels/cubins/ that today's binding is read from."""
    copy = tmp_path / "cubins"
    shutil.copytree(sources.SHIPPED_DIR, copy)
    monkeypatch.setattr(sources, "SHIPPED_DIR", copy)
    return copy


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_every_arch_ships_its_cubins_and_a_changed_cubin_turns_its_scope_off(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = kernel_entry(
        dataclasses.replace(scope.RMSNORM, archs=(arch,)), f"{arch}.json", tmp_path
    )
    assert norm_on(arch, entry) == (True, f"opted in, inside a scope validated by {arch}.json")
    # Evidence that recorded a made-up cubin hash covers nothing.
    data = json.loads((tmp_path / f"{arch}.json").read_text())
    files = data["binding"]["files_sha256"]
    cubin = next(f for f in files if f.endswith(".cubin"))
    files[cubin] = "0" * 64
    (tmp_path / "made-up.json").write_text(json.dumps(data))
    enabled, why = norm_on(arch, dataclasses.replace(entry, evidence="made-up.json"))
    assert not enabled and f"cubin or PTX changed since (or not recorded): ['{cubin}']" in why
    # The shipped cubin rebuilt after the run (manifest updated to match): off too.
    copy = shipped_copy(tmp_path, monkeypatch)
    manifest = json.loads((copy / "manifest.json").read_text())
    for e in manifest["kernels"]:
        if e["cubin"] == cubin:
            (copy / cubin).write_bytes((copy / cubin).read_bytes() + b"\0")
            e["cubin_sha256"] = sources.file_sha256(copy / cubin)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    enabled, why = norm_on(arch, entry)
    assert not enabled and f"cubin or PTX changed since (or not recorded): ['{cubin}']" in why


def test_a_made_up_cubin_hash_counts_for_nothing_in_show(tmp_path: Path) -> None:
    for arch in ALL_ARCHS:
        kernel_entry(dataclasses.replace(scope.RMSNORM, archs=(arch,)), f"{arch}.json", tmp_path)
        data = json.loads((tmp_path / f"{arch}.json").read_text())
        data["binding"]["files_sha256"] = {"x.cubin": "0" * 64}
        (tmp_path / f"{arch}.json").write_text(json.dumps(data))
    shown = evidence.show(tmp_path)
    assert shown.count("unvalidated") == len(ALL_ARCHS), shown


def test_changed_launch_settings_turn_the_scope_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = kernel_entry(dataclasses.replace(scope.RMSNORM, archs=("sm_90a",)), "k.json", tmp_path)
    assert norm_on("sm_90a", entry)[0]
    copy = shipped_copy(tmp_path, monkeypatch)
    manifest = json.loads((copy / "manifest.json").read_text())
    for e in manifest["kernels"]:
        if e["arch"] == "sm_90a":
            e["threads"] = 128  # the files are untouched: CubinSet.open would accept them
    (copy / "manifest.json").write_text(json.dumps(manifest))
    enabled, why = norm_on("sm_90a", entry)
    assert not enabled and "stale: made from launch settings" in why
    # Another arch's settings are not this evidence's.
    other = kernel_entry(dataclasses.replace(scope.RMSNORM, archs=("sm_100a",)), "o.json", tmp_path)
    assert norm_on("sm_100a", other)[0]


@pytest.mark.parametrize("name", sources.HARNESS_FILES)
def test_a_changed_harness_or_launcher_turns_the_scope_off(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = kernel_entry(dataclasses.replace(scope.RMSNORM, archs=("sm_90a",)), "k.json", tmp_path)
    assert norm_on("sm_90a", entry)[0]
    harness = tmp_path / "harness"
    harness.mkdir()
    for f in sources.HARNESS_FILES:
        shutil.copy(sources.KERNELS_DIR / f, harness / f)
    (harness / name).write_text((harness / name).read_text() + "\n# changed\n")
    monkeypatch.setattr(sources, "KERNELS_DIR", harness)
    enabled, why = norm_on("sm_90a", entry)
    assert not enabled and "stale: made from harness and launcher" in why


def test_ab_evidence_enables_only_the_exact_vllm_version_it_ran(tmp_path: Path) -> None:
    measured = dataclasses.replace(
        scope.KIMI_K3,
        archs=("sm_103a",),
        parallel=((8, 8),),
        max_batch=64,
        vllm_versions=("0.33.0",),
    )
    entry = ab_entry(measured, "ab.json", tmp_path)
    kimi = scope.KIMI_K3.name
    assert decision_for(kimi, KIMI_K3_GB300, (entry,), [kimi]).enabled
    # An entry claiming the series from 0.33.0 evidence: refused, for 0.33.0 and 0.33.9.
    series = dataclasses.replace(
        entry, scope=dataclasses.replace(measured, vllm_versions=("0.33",))
    )
    for version in ("0.33.0", "0.33.9"):
        engine = dataclasses.replace(KIMI_K3_GB300, vllm_version=version)
        decision = decision_for(kimi, engine, (series,), [kimi])
        assert not decision.enabled
        assert "ab.json: vLLM 0.33.0, scope claims ['0.33']" in decision.reason
    later = dataclasses.replace(KIMI_K3_GB300, vllm_version="0.33.9")
    assert not decision_for(kimi, later, (entry,), [kimi]).enabled
    # A missing file backs nothing.
    gone = dataclasses.replace(entry, evidence="gone.json")
    decision = decision_for(kimi, KIMI_K3_GB300, (gone,), [kimi])
    assert not decision.enabled and "cannot read gone.json" in decision.reason
