"""kvtide's decode kernels: compile time and resource usage per arch; µs per call on a GPU.

Run from the repository root:

    python benchmarks/kernels.py [--arch sm_90a] [--cubins DIR] [--repeats 200]

Part 1 (anywhere nvidia-cutlass-dsl installs, no GPU needed): compiles every kernel
variant for every arch in scope and prints compile seconds, registers, spills, shared
memory, 128-bit loads in the PTX and the PTX target.

Part 2 (CUDA GPU only; says so and stops elsewhere): µs per call of the kernel, launched
from cubins, against each baseline an engine runs without it (``kernels.baselines``:
vLLM's op where its GPU build is installed, ``torch.compile`` of the reference, the
eager reference), all under CUDA graphs (``kernels.timing.time_cuda``: median, and the
spread p90-p10 over the median), at decode shapes: fused add + RMSNorm, hidden
4096/7168/8192, 1/64/1024 tokens, bf16 and FP8 out.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.compile import compile_all, format_report
from kernels.cute import CutlassUnavailable
from orchestrator.cli.table import format_table


def compile_table(archs: list[str] | None) -> Path | None:
    out = Path(tempfile.mkdtemp(prefix="kvt-bench-cubins-"))
    try:
        compiled = compile_all(out, archs=archs, sass=True)
    except CutlassUnavailable as exc:
        print(f"compile: skipped ({exc})")
        return None
    print(format_report(compiled))
    print(f"total compile time {sum(k.compile_s for k in compiled):.1f} s, {len(compiled)} cubins")
    return out


def timing_table(cubin_dir: Path | None, repeats: int) -> None:
    import torch

    from kernels.baselines import rmsnorm_baselines
    from kernels.ops import CubinSet, Kernels
    from kernels.timing import time_cuda

    if not torch.cuda.is_available():
        print("\nµs per call: no CUDA GPU here; run this on a GPU host for kernel vs stock timings")
        return
    from kernels.compile import SHIPPED_DIR

    device = torch.device("cuda", 0)
    kernels = Kernels(CubinSet.open(cubin_dir or SHIPPED_DIR), device)
    baselines = rmsnorm_baselines(device)
    print(f"\nµs per call on {torch.cuda.get_device_name(device)} ({kernels.arch}), CUDA graphs")
    rows: list[list[str]] = []
    scale = torch.tensor([0.05], device=device)
    for hidden in (4096, 7168, 8192):
        for tokens in (1, 64, 1024):
            x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
            res = torch.randn_like(x)
            w = torch.randn(hidden, device=device, dtype=torch.bfloat16)
            for sc in (None, scale):
                k = time_cuda(
                    lambda x=x, r=res, w=w, sc=sc: kernels.fused_add_rmsnorm(x, r, w, 1e-6, sc),
                    repeats=repeats,
                )
                row = [
                    f"add+rmsnorm h{hidden} t{tokens} {'bf16' if sc is None else 'fp8'}",
                    f"{k.median_us:.2f} ±{k.spread:.0%}",
                ]
                for name in ("vllm", "torch_compile", "torch"):
                    call = baselines.get(name)
                    if call is None:
                        row.append("-")
                        continue
                    xc, rc = x.clone(), res.clone()
                    t = time_cuda(
                        lambda c=call, a=xc, r=rc, w=w, sc=sc: c(a, r, w, 1e-6, sc), repeats=repeats
                    )
                    row.append(f"{t.median_us:.2f} ({t.median_us / k.median_us:.2f}x)")
                rows.append(row)
    print(format_table(["case", "kernel", "vllm", "torch.compile", "torch"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", help="compile only this arch (repeatable)")
    parser.add_argument("--cubins", type=Path, help="time these cubins (default: compiled here)")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    compiled_dir = compile_table(args.arch)
    timing_table(args.cubins or compiled_dir, args.repeats)


if __name__ == "__main__":
    main()
