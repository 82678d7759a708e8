"""Compile every kernel variant for every arch in scope, on a CPU, and say what it uses.

``cute.compile(fn, *placeholders, options="--gpu-arch sm_XXa --keep-ptx --keep-cubin
--dump-dir D")`` needs nvidia-cutlass-dsl but no GPU, driver or CUDA toolkit. Output:

    OUT/manifest.json                 what ``kernels.launch`` needs to run each cubin
    OUT/<arch>/<kernel>-<variant>.cubin
    OUT/<arch>/<kernel>-<variant>.ptx

The manifest records the nvidia-cutlass-dsl version, a digest of the kernel sources and
the sha256 of every cubin and PTX file, so a stale or altered cubin is detectable
(``tests/unit/test_kernels_compile.py`` checks the ones shipped in ``kernels/cubins/``).
"""

from __future__ import annotations

import importlib
import json
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernels.cute import dsl_version, load_dsl
from kernels.cute.add_rmsnorm import Geometry
from kernels.resources import CubinUsage, cubin_usage, ptx_summary
from kernels.scope import ALL_ARCHS, SCOPES, KernelScope, Variant
from kernels.sources import SHIPPED_DIR, file_sha256, source_digest

__all__ = [
    "SHIPPED_ARCHS",
    "SHIPPED_DIR",
    "CompiledKernel",
    "compile_all",
    "compile_variant",
    "format_report",
    "geometry",
    "source_digest",
    "write_manifest",
]

# The cubins kept in the repository, for every arch in scope: what a bare GPU host (no
# nvidia-cutlass-dsl) launches, and what kernel evidence is bound to.
SHIPPED_ARCHS: tuple[str, ...] = ALL_ARCHS

_MODULES = {
    "fused_add_rmsnorm": "kernels.cute.add_rmsnorm",
}


def _module(kernel: str) -> Any:
    return importlib.import_module(_MODULES[kernel])


def geometry(variant: Variant) -> Geometry:
    """Launch geometry of a variant; pure, cutlass not needed."""
    return _module(variant.kernel).geometry(variant)  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True, kw_only=True)
class CompiledKernel:
    """One variant compiled for one arch; paths are inside the output directory."""

    variant: Variant
    arch: str
    cubin: Path
    ptx: Path
    entry: str
    params: tuple[str, ...]
    ptx_target: str
    geometry: Geometry
    compile_s: float
    usage: CubinUsage | None

    def manifest_entry(self, root: Path) -> dict[str, Any]:
        return {
            "kernel": self.variant.kernel,
            "variant": self.variant.name,
            "params": dict(self.variant.params),
            "arch": self.arch,
            "cubin": self.cubin.relative_to(root).as_posix(),
            "ptx": self.ptx.relative_to(root).as_posix(),
            "cubin_sha256": file_sha256(self.cubin),
            "ptx_sha256": file_sha256(self.ptx),
            "entry": self.entry,
            "entry_params": list(self.params),
            "threads": self.geometry.threads,
            "rows_per_cta": self.geometry.rows_per_cta,
            "smem_bytes": self.geometry.smem_bytes,
            "registers": None if self.usage is None else self.usage.registers,
            "local_bytes": None if self.usage is None else self.usage.local_bytes,
        }


def compile_variant(
    variant: Variant, arch: str, out_dir: Path, sass: bool = False
) -> CompiledKernel:
    """Compile ``variant`` for ``arch`` into ``out_dir/<arch>/`` (``sass``: count spill
    instructions in the disassembly too)."""
    dsl = load_dsl()
    fn, args = _module(variant.kernel).build(dsl, variant)
    dest = out_dir / arch
    dest.mkdir(parents=True, exist_ok=True)
    stem = f"{variant.kernel}-{variant.name}"
    # The DSL names its dumps after the host function; one scratch dir per compile.
    with tempfile.TemporaryDirectory(prefix="kvt-cute-") as scratch:
        options = f"--gpu-arch {arch} --keep-ptx --keep-cubin --dump-dir {scratch}"
        start = time.perf_counter()
        dsl.cute.compile(fn, *args, options=options)
        elapsed = time.perf_counter() - start
        produced = {p.suffix: p for p in Path(scratch).iterdir()}
        if ".ptx" not in produced or ".cubin" not in produced:
            raise RuntimeError(f"compiling {variant.variant_id} for {arch} left {sorted(produced)}")
        ptx_path = dest / f"{stem}.ptx"
        cubin_path = dest / f"{stem}.cubin"
        shutil.move(produced[".ptx"], ptx_path)
        shutil.move(produced[".cubin"], cubin_path)
    summary = ptx_summary(ptx_path.read_text())
    return CompiledKernel(
        variant=variant,
        arch=arch,
        cubin=cubin_path,
        ptx=ptx_path,
        entry=summary.entry.name,
        params=summary.entry.params,
        ptx_target=summary.target,
        geometry=geometry(variant),
        compile_s=elapsed,
        usage=cubin_usage(cubin_path, sass=sass),
    )


def compile_all(
    out_dir: Path,
    archs: Iterable[str] | None = None,
    scopes: Iterable[KernelScope] = SCOPES,
    sass: bool = False,
) -> list[CompiledKernel]:
    """Every variant of every scope for every arch in its scope (or in ``archs``)."""
    wanted = None if archs is None else set(archs)
    compiled = []
    for scope in scopes:
        for arch in scope.archs:
            if wanted is not None and arch not in wanted:
                continue
            for variant in scope.variants():
                compiled.append(compile_variant(variant, arch, out_dir, sass=sass))
    write_manifest(compiled, out_dir)
    return compiled


def write_manifest(compiled: list[CompiledKernel], out_dir: Path) -> Path:
    manifest = {
        "nvidia_cutlass_dsl": dsl_version(),
        "source_sha256": source_digest(),
        "kernels": [k.manifest_entry(out_dir) for k in compiled],
    }
    path = out_dir / "manifest.json"
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return path


def format_report(compiled: list[CompiledKernel]) -> str:
    """A table: compile time, registers, spills, shared memory, PTX target per cubin."""
    head = (
        f"{'kernel/variant':<34} {'arch':<8} {'compile_s':>9} {'regs':>5} "
        f"{'spill':>6} {'smem_B':>6} {'v4 ld':>5}  target"
    )
    lines = [head, "-" * len(head)]
    for k in compiled:
        summary = ptx_summary(k.ptx.read_text())
        if k.usage is None:
            regs, spill, smem = "?", "?", "?"
        else:
            regs = str(k.usage.registers)
            spill = "yes" if k.usage.spills else "no"
            smem = str(k.usage.shared_bytes)
        lines.append(
            f"{k.variant.variant_id:<34} {k.arch:<8} {k.compile_s:>9.2f} {regs:>5} "
            f"{spill:>6} {smem:>6} {summary.global_v4_loads:>5}  {k.ptx_target}"
        )
    if any(k.usage is None for k in compiled):
        lines.append("(?: cuobjdump not found; pip install nvidia-cuda-cuobjdump)")
    return "\n".join(lines)
