"""kvtide's decode kernels: compile time and resource usage per arch; µs per call on a GPU.

Run from the repository root:

    python benchmarks/kernels.py [--arch sm_90a] [--cubins DIR] [--repeats 200]

Part 1 (anywhere nvidia-cutlass-dsl installs, no GPU needed): compiles every kernel
variant for every arch in scope and prints compile seconds, registers, spills, shared
memory, 128-bit loads in the PTX and the PTX target.

Part 2 (CUDA GPU only; says so and stops elsewhere): median µs per call of each kernel,
launched from cubins, against the stock path (the torch reference on the same GPU, what
an engine runs without the kernel), at decode shapes:

- DCP LSE combine, DeepSeek/Kimi MLA (D=512, 16 heads per rank after the gather) and a
  GQA model (D=128, 32 heads), batch 1/64/256, 2-16 ranks;
- fused add + RMSNorm, hidden 4096/7168/8192, 1/64/1024 tokens, bf16 and FP8 out.
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

    from kernels import reference
    from kernels.ops import CubinSet, Kernels
    from kernels.validate import time_us

    if not torch.cuda.is_available():
        print("\nµs per call: no CUDA GPU here; run this on a GPU host for kernel vs stock timings")
        return
    from kernels.compile import SHIPPED_DIR

    device = torch.device("cuda", 0)
    kernels = Kernels(CubinSet.open(cubin_dir or SHIPPED_DIR), device)
    print(f"\nµs per call on {torch.cuda.get_device_name(device)} ({kernels.arch}), median")
    rows: list[list[str]] = []

    def row(name: str, kernel_fn: object, stock_fn: object) -> None:
        k = time_us(kernel_fn, repeats=repeats)  # type: ignore[arg-type]
        s = time_us(stock_fn, repeats=repeats)  # type: ignore[arg-type]
        rows.append([name, f"{k:.1f}", f"{s:.1f}", f"{s / k:.2f}x"])

    for d, heads in ((512, 16), (128, 32)):
        for batch in (1, 64, 256):
            for ranks in (2, 8, 16):
                parts = torch.randn(ranks, batch, heads, d, device=device, dtype=torch.bfloat16)
                lses = torch.randn(ranks, batch, heads, device=device)
                row(
                    f"combine d{d} h{heads} b{batch} n{ranks}",
                    lambda p=parts, lse=lses: kernels.lse_combine(p, lse),
                    lambda p=parts, lse=lses: reference.lse_combine(p, lse),
                )
    scale = torch.tensor([0.05], device=device)
    for hidden in (4096, 7168, 8192):
        for tokens in (1, 64, 1024):
            x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
            res = torch.randn_like(x)
            w = torch.randn(hidden, device=device, dtype=torch.bfloat16)
            for sc in (None, scale):
                out = "bf16" if sc is None else "fp8"
                row(
                    f"add+rmsnorm h{hidden} t{tokens} {out}",
                    lambda x=x, r=res, w=w, sc=sc: kernels.fused_add_rmsnorm(x, r, w, 1e-6, sc),
                    lambda x=x, r=res, w=w, sc=sc: reference.fused_add_rmsnorm(x, r, w, 1e-6, sc),
                )
    print(format_table(["case", "kernel", "stock", "speed-up"], rows))


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
