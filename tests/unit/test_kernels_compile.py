"""Every kernel compiles for every arch in scope on this CPU, and the PTX and cubin show
what the kernels promise: the right target, no local memory, registers within budget,
128-bit vector loads, FP8 conversion with saturation, and an entry the cubin launcher
can call. The shipped cubins are what today's sources compile to, and their manifest
records each file's sha256.

One compile of everything per test session (~10 s); skipped, saying why, only where
nvidia-cutlass-dsl cannot be imported.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kernels import compile as kc
from kernels.cute import CutlassUnavailable, dsl_version, load_dsl
from kernels.resources import find_tool, ptx_summary, sass_opcodes
from kernels.scope import ALL_ARCHS, SCOPES
from kernels.sources import LAUNCH_FIELDS

REGISTER_BUDGET = {"fused_add_rmsnorm": 64}
ENTRY_PARAMS = {"fused_add_rmsnorm": ("u64",) * 6 + ("u32", "f32")}
# What docs/kernels.md's resource table states (nvidia-cutlass-dsl 4.8.0, cuobjdump).
DOCUMENTED_REGISTERS = {"fused_add_rmsnorm": {"sm_90a": 48, "sm_100a": 48, "sm_103a": 48}}


@pytest.fixture(scope="session")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> list[kc.CompiledKernel]:
    try:
        load_dsl()
    except CutlassUnavailable as exc:
        pytest.skip(f"nvidia-cutlass-dsl cannot be imported here: {exc}")
    return kc.compile_all(tmp_path_factory.mktemp("cubins"))


def test_every_kernel_compiles_for_every_arch_in_scope(compiled: list[kc.CompiledKernel]) -> None:
    want = {(v.variant_id, arch) for s in SCOPES for arch in s.archs for v in s.variants()}
    assert {(k.variant.variant_id, k.arch) for k in compiled} == want
    assert {k.arch for k in compiled} == {"sm_90a", "sm_100a", "sm_103a"}
    for k in compiled:
        assert k.ptx_target == k.arch, k.variant.variant_id
        assert k.cubin.stat().st_size > 0


def test_no_local_memory_and_registers_within_budget(compiled: list[kc.CompiledKernel]) -> None:
    for k in compiled:
        summary = ptx_summary(k.ptx.read_text())
        assert not summary.uses_local_memory, k.variant.variant_id
        if k.usage is None:
            pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
        name = f"{k.variant.variant_id}@{k.arch}"
        assert k.usage.local_bytes == 0 and k.usage.stack_bytes == 0, name
        assert k.usage.registers <= REGISTER_BUDGET[k.variant.kernel], (name, k.usage.registers)


def test_registers_are_what_the_docs_and_the_shipped_manifest_say(
    compiled: list[kc.CompiledKernel],
) -> None:
    if any(k.usage is None for k in compiled):
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    manifest = json.loads((kc.SHIPPED_DIR / "manifest.json").read_text())
    shipped = {(e["kernel"], e["variant"], e["arch"]): e["registers"] for e in manifest["kernels"]}
    docs = (Path(__file__).resolve().parents[2] / "docs" / "kernels.md").read_text()
    for k in compiled:
        assert k.usage is not None
        regs = k.usage.registers
        assert regs == DOCUMENTED_REGISTERS[k.variant.kernel][k.arch], (
            k.variant.variant_id,
            k.arch,
        )
        assert shipped.get((k.variant.kernel, k.variant.name, k.arch), regs) == regs
    row = " / ".join(str(DOCUMENTED_REGISTERS["fused_add_rmsnorm"][a]) for a in ALL_ARCHS)
    assert f"| add + RMSNorm (bf16 or FP8 out) | {row} |" in docs


def test_rmsnorm_moves_vectors_and_converts_fp8_with_saturation(
    compiled: list[kc.CompiledKernel],
) -> None:
    for k in compiled:
        if k.variant.kernel != "fused_add_rmsnorm":
            continue
        ptx = k.ptx.read_text()
        # x, residual, weight: one 128-bit load each per vector, four vectors per thread.
        assert ptx_summary(ptx).global_v4_loads == 12
        assert len(re.findall(r"st\.global\.v4\.b32", ptx)) >= 4  # new residual
        assert "rsqrt.approx" in ptx
        if k.variant.param("out_dtype") == "fp8_e4m3":
            assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
            assert len(re.findall(r"st\.global\.v2\.b32", ptx)) == 4


def test_entries_take_what_the_launcher_passes(compiled: list[kc.CompiledKernel]) -> None:
    for k in compiled:
        assert k.params == ENTRY_PARAMS[k.variant.kernel]
        entry = ptx_summary(k.ptx.read_text()).entry
        assert entry.reqntid == (k.geometry.threads, 1, 1)


def test_sass_has_no_spill_instructions(compiled: list[kc.CompiledKernel]) -> None:
    if find_tool("nvdisasm") is None:
        pytest.skip("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    # One cubin per kernel (~0.5 s of nvdisasm each); resource usage covers them all.
    picked = {"fused_add_rmsnorm/bf16-fp8_e4m3"}
    for k in compiled:
        if k.arch != "sm_90a" or k.variant.variant_id not in picked:
            continue
        opcodes = sass_opcodes(k.cubin)
        assert opcodes is not None
        assert opcodes["LDL"] + opcodes["STL"] == 0, k.variant.variant_id
        assert opcodes["LDG"] > 0


def test_shipped_cubins_are_what_the_sources_compile_to(
    compiled: list[kc.CompiledKernel],
) -> None:
    manifest = json.loads((kc.SHIPPED_DIR / "manifest.json").read_text())
    assert manifest["source_sha256"] == kc.source_digest(), (
        "kernel sources changed: run `python -m kernels compile --ship` and commit kernels/cubins"
    )
    shipped = {(e["kernel"], e["variant"], e["arch"]): e for e in manifest["kernels"]}
    fresh = [k for k in compiled if k.arch in kc.SHIPPED_ARCHS]
    assert {(k.variant.kernel, k.variant.name, k.arch) for k in fresh} == set(shipped)
    if manifest["nvidia_cutlass_dsl"] != dsl_version():
        pytest.skip(f"shipped with nvidia-cutlass-dsl {manifest['nvidia_cutlass_dsl']}")
    assert {k.arch for k in fresh} == set(ALL_ARCHS)  # every arch in scope ships
    for k in fresh:
        entry = shipped[(k.variant.kernel, k.variant.name, k.arch)]
        # Byte for byte against this compile, the cubin and the PTX.
        assert (kc.SHIPPED_DIR / entry["cubin"]).read_bytes() == k.cubin.read_bytes()
        assert (kc.SHIPPED_DIR / entry["ptx"]).read_bytes() == k.ptx.read_bytes()
        # The manifest binds each file by its hash (evidence copies these), and its
        # launch settings are the compile's.
        fresh_entry = k.manifest_entry(k.cubin.parents[1])
        for key in (*LAUNCH_FIELDS, "cubin", "ptx", "cubin_sha256", "ptx_sha256"):
            assert entry[key] == fresh_entry[key], (k.arch, k.variant.name, key)


def test_report_names_every_cubin(compiled: list[kc.CompiledKernel]) -> None:
    report = kc.format_report(compiled)
    assert len(report.splitlines()) >= len(compiled) + 2
    assert "fused_add_rmsnorm/bf16-fp8_e4m3" in report and "sm_103a" in report


def test_geometry_needs_no_cutlass() -> None:
    norm = SCOPES[0].variants()[0]
    assert kc.geometry(norm).threads == 256 and kc.geometry(norm).rows_per_cta == 1
    assert Path(kc.SHIPPED_DIR / "manifest.json").is_file()


def test_kernel_layouts_address_torch_contiguous_tensors() -> None:
    # CuTe's default layout is column-major; torch's is row-major. Evaluate the kernel's
    # row layout with a small static size and compare every offset with torch's.
    from kernels.cute import add_rmsnorm

    try:
        dsl = load_dsl()
    except CutlassUnavailable as exc:
        pytest.skip(f"nvidia-cutlass-dsl cannot be imported here: {exc}")
    cutlass, cute = dsl.cutlass, dsl.cute
    hidden = 48
    got: list[tuple[tuple[int, int], int]] = []

    @dsl.jit
    def probe() -> None:
        one_row = add_rmsnorm.row_layout(cute, hidden)
        for col in cutlass.range_constexpr(hidden // 8):
            for e in (0, 3, 7):
                got.append(((col, e), cute.crd2idx((col, e), one_row)))

    probe()
    assert got
    for (col, e), offset in got:
        assert int(offset) == col * 8 + e, (col, e, offset)
