"""DCP LSE combine in CuTe DSL: ``[N, R, D]`` partials + ``[N, R]`` LSEs → ``[R, D]`` + ``[R]``.

``R = B * H`` rows; ``N`` (ranks) and ``R`` are runtime arguments, ``D`` and the dtype are
compile-time (one cubin per variant). Matches ``kernels.reference.lse_combine``.

Work split: a row's ``D`` elements are spread over ``D / 8`` threads, each owning one
128-bit vector (8 bf16/fp16), so every partial is read with one ``ld.global.v4`` per
thread per rank and the output written with one ``st.global.v4``. A 128-thread CTA
handles ``128 / (D / 8)`` rows. Per row, in fp32:

1. ``m = max_r lse_r`` over ranks, with +inf and NaN read as -inf (an empty rank);
2. ``w_r = 2^((lse_r - m) * log2 e)`` (``ex2.approx``), 0 for an empty rank;
3. ``out = sum_r w_r * partial_r / sum_r w_r``, skipping ranks with ``w_r == 0`` so a
   garbage partial from an empty rank is never read; out = 0 when every rank is empty;
4. ``lse = m + ln(sum_r w_r)``, or -inf when every rank is empty (lane 0 writes it).

Entry parameters: ``(partials u64, lses u64, out u64, out_lse u64, num_ranks u32,
num_rows u32)``; pointers 16-byte aligned for the vectors, LSEs fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kernels.cute import Dsl
from kernels.scope import Variant

__all__ = ["Geometry", "build", "geometry", "layouts"]

VEC = 8  # elements per 128-bit access
THREADS = 128


@dataclass(frozen=True, slots=True, kw_only=True)
class Geometry:
    threads: int
    rows_per_cta: int
    smem_bytes: int = 0

    def grid(self, num_rows: int) -> int:
        return -(-num_rows // self.rows_per_cta)


def geometry(variant: Variant) -> Geometry:
    head_dim = int(variant.param("head_dim"))
    if head_dim % VEC or THREADS % (head_dim // VEC):
        raise ValueError(f"head dim {head_dim} does not tile into {THREADS} threads x {VEC}")
    return Geometry(threads=THREADS, rows_per_cta=THREADS // (head_dim // VEC))


def layouts(cute: Any, num_ranks: Any, num_rows: Any, head_dim: int) -> tuple[Any, ...]:
    """Layouts of ``(partials, lses, out, out_lse)``, all row-major contiguous like the
    torch tensors: partials ``(rank, row, thread-in-row, element)``, LSEs ``(rank, row)``,
    out ``(row, thread-in-row, element)``, out LSE ``(row,)``. (CuTe's default layout is
    column-major, so every stride is spelled out; a test checks the offsets.)"""
    tpr = head_dim // VEC
    return (
        cute.make_layout(
            (num_ranks, num_rows, tpr, VEC), stride=(num_rows * head_dim, head_dim, VEC, 1)
        ),
        cute.make_layout((num_ranks, num_rows), stride=(num_rows, 1)),
        cute.make_layout((num_rows, tpr, VEC), stride=(head_dim, VEC, 1)),
        cute.make_layout((num_rows,), stride=(1,)),
    )


def build(dsl: Dsl, variant: Variant) -> tuple[Any, tuple[Any, ...]]:
    """The host function to compile for ``variant`` and placeholder arguments."""
    cutlass, cute = dsl.cutlass, dsl.cute
    f32 = dsl.Float32
    head_dim = int(variant.param("head_dim"))
    dtype_name = str(variant.param("dtype"))
    elem = dsl.dtype(dtype_name)
    geo = geometry(variant)
    tpr = head_dim // VEC  # threads per row
    rows_per_cta = geo.rows_per_cta
    log2e = math.log2(math.e)
    ln2 = math.log(2.0)

    @dsl.kernel
    def combine_kernel(
        partials: Any, lses: Any, out: Any, out_lse: Any, num_ranks: Any, num_rows: Any
    ) -> None:
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        row = bidx * rows_per_cta + tidx // tpr
        lane = tidx % tpr
        if row < num_rows:
            parts_l, lse_l, out_l, out_lse_l = layouts(cute, num_ranks, num_rows, head_dim)
            g_parts = cute.make_tensor(partials, parts_l)
            g_lse = cute.make_tensor(lses, lse_l)
            g_out = cute.make_tensor(out, out_l)
            g_out_lse = cute.make_tensor(out_lse, out_lse_l)

            # 1. max LSE; +inf and NaN mean "no token on this rank".
            lse_max = -f32.inf
            for r in cutlass.range(num_ranks, unroll=4):
                lse = g_lse[r, row]
                lse = f32(cutlass.select_(lse == f32.inf or lse != lse, -f32.inf, lse))
                lse_max = cute.arch.fmax(lse_max, lse)
            lse_max = f32(cutlass.select_(lse_max == -f32.inf, f32(0.0), lse_max))

            # 2-3. weighted sum; an empty rank (weight 0) is never loaded.
            total = f32(0.0)
            acc = cute.make_rmem_tensor(cute.make_layout((VEC,)), f32)
            acc.fill(0.0)
            for r in cutlass.range(num_ranks, unroll=4):
                lse = g_lse[r, row]
                w = cute.math.exp2((lse - lse_max) * log2e, fastmath=True)
                w = f32(cutlass.select_(w > 0.0 and lse != f32.inf, w, f32(0.0)))
                total = total + w
                if w > 0.0:
                    part = g_parts[r, row, lane, None].load().to(f32)
                    acc.store(acc.load() + part * w)

            inv = f32(cutlass.select_(total > 0.0, 1.0 / total, f32(0.0)))
            res = cute.make_rmem_tensor(cute.make_layout((VEC,)), elem)
            res.store((acc.load() * inv).to(elem))
            cute.autovec_copy(res, g_out[row, lane, None])

            # 4. merged LSE, natural log.
            if lane == 0:
                merged = lse_max + cute.math.log2(total, fastmath=True) * ln2
                g_out_lse[row] = f32(cutlass.select_(total > 0.0, merged, -f32.inf))

    @dsl.jit
    def launch(
        partials: Any, lses: Any, out: Any, out_lse: Any, num_ranks: Any, num_rows: Any
    ) -> None:
        combine_kernel(partials, lses, out, out_lse, num_ranks, num_rows).launch(
            grid=[(num_rows + rows_per_cta - 1) // rows_per_cta, 1, 1],
            block=[geo.threads, 1, 1],
        )

    args = (
        dsl.gmem_ptr(dtype_name, 16),
        dsl.gmem_ptr("fp32", 4),
        dsl.gmem_ptr(dtype_name, 16),
        dsl.gmem_ptr("fp32", 4),
        dsl.Int32(2),
        dsl.Int32(1),
    )
    return launch, args
