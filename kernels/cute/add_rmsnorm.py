"""Fused residual add + RMSNorm in CuTe DSL, bf16 in, bf16 or FP8 e4m3 out.

One 256-thread CTA per token row. The hidden size is a runtime argument (a multiple of 8,
at most ``VECS_PER_THREAD * 256 * 8`` = 8192); the output dtype is compile-time. Matches
``kernels.reference.fused_add_rmsnorm``:

1. each thread loads up to four 128-bit vectors of ``x`` and ``residual`` (``ld.global.v4``),
   adds them in fp32, rounds to bf16, stores that as the new residual (``st.global.v4``)
   and keeps it, widened, in registers with its sum of squares;
2. warp shuffles then 8 fp32 slots of shared memory reduce the sum over the row;
3. ``y = z * rsqrt(mean + eps) * weight``; bf16 out, or ``y / scale`` clamped to ±448 and
   converted with ``cvt.rn.satfinite.e4m3x2`` (8 bytes per vector, ``st.global.v2``).

``out`` may alias ``x`` and ``residual_out`` may alias ``residual`` (vLLM's in-place
form): each thread reads its own elements before it writes them.

Entry parameters: ``(x u64, residual u64, weight u64, out u64, residual_out u64,
scale u64, hidden u32, eps f32)``; ``scale`` is one fp32 (read only for FP8 output).
Dynamic shared memory: ``SMEM_BYTES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kernels.cute import Dsl
from kernels.scope import Variant

__all__ = ["SMEM_BYTES", "Geometry", "build", "geometry", "row_layout"]

VEC = 8
THREADS = 256
WARPS = THREADS // 32
VECS_PER_THREAD = 4
MAX_HIDDEN = VECS_PER_THREAD * THREADS * VEC
SMEM_BYTES = 4 * WARPS
FP8_E4M3_MAX = 448.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Geometry:
    """Launch geometry of a cubin: threads per CTA, rows per CTA, dynamic shared memory."""

    threads: int
    rows_per_cta: int
    smem_bytes: int = 0

    def grid(self, num_rows: int) -> int:
        return -(-num_rows // self.rows_per_cta)


def geometry(variant: Variant) -> Geometry:
    max_hidden = int(variant.param("max_hidden"))
    if max_hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {max_hidden} over the kernel's {MAX_HIDDEN}")
    return Geometry(threads=THREADS, rows_per_cta=1, smem_bytes=SMEM_BYTES)


def row_layout(cute: Any, hidden: Any) -> Any:
    """One row of ``hidden`` elements as ``(vector, element)``, row-major; a row starts at
    ``row * hidden`` elements (a test checks the offsets)."""
    return cute.make_layout((hidden // VEC, VEC), stride=(VEC, 1))


def build(dsl: Dsl, variant: Variant) -> tuple[Any, tuple[Any, ...]]:
    """The host function to compile for ``variant`` and placeholder arguments."""
    cutlass, cute = dsl.cutlass, dsl.cute
    f32 = dsl.Float32
    dtype_name = str(variant.param("dtype"))
    out_name = str(variant.param("out_dtype"))
    elem = dsl.dtype(dtype_name)
    out_t = dsl.dtype(out_name)
    fp8_out = out_name == "fp8_e4m3"
    geo = geometry(variant)

    @dsl.kernel
    def add_rmsnorm_kernel(
        x: Any,
        residual: Any,
        weight: Any,
        out: Any,
        residual_out: Any,
        scale: Any,
        hidden: Any,
        eps: Any,
    ) -> None:
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        # Rows start 16-byte aligned only because hidden % 8 == 0: tell the compiler.
        hidden = cute.assume(hidden, divby=VEC)
        one_row = row_layout(cute, hidden)
        offset = row * hidden
        g_x = cute.make_tensor(x + offset, one_row)
        g_res = cute.make_tensor(residual + offset, one_row)
        g_res_out = cute.make_tensor(residual_out + offset, one_row)
        g_out = cute.make_tensor(out + offset, one_row)
        g_w = cute.make_tensor(weight, one_row)

        smem = cutlass.memory.SmemAllocator()
        partial_sums = smem.allocate_tensor(f32, cute.make_layout((WARPS,)), byte_alignment=16)
        z = cute.make_rmem_tensor(cute.make_layout((VECS_PER_THREAD, VEC), stride=(VEC, 1)), f32)

        # 1. residual add, rounded to the model dtype, kept widened in registers.
        sum_sq = f32(0.0)
        for v in cutlass.range_constexpr(VECS_PER_THREAD):
            col = v * THREADS + tidx
            if col * VEC < hidden:
                added = g_x[col, None].load().to(f32) + g_res[col, None].load().to(f32)
                rounded = added.to(elem)
                g_res_out[col, None].store(rounded)
                wide = rounded.to(f32)
                z[v, None].store(wide)
                sum_sq = sum_sq + (wide * wide).reduce(cute.ReductionOp.ADD, f32(0.0), 0)

        # 2. row sum: warp shuffles, then one slot per warp in shared memory.
        sum_sq = cute.arch.warp_reduction_sum(sum_sq)
        if tidx % 32 == 0:
            partial_sums[tidx // 32] = sum_sq
        cute.arch.sync_threads()
        total = f32(0.0)
        for i in cutlass.range_constexpr(WARPS):
            total = total + partial_sums[i]
        inv_rms = cute.math.rsqrt(total / hidden.to(f32) + eps, fastmath=True)
        if cutlass.const_expr(fp8_out):
            inv_rms = inv_rms / cute.make_tensor(scale, cute.make_layout((1,)))[0]

        # 3. normalise, scale by the weight, convert once.
        for v in cutlass.range_constexpr(VECS_PER_THREAD):
            col = v * THREADS + tidx
            if col * VEC < hidden:
                y = z[v, None].load() * inv_rms * g_w[col, None].load().to(f32)
                if cutlass.const_expr(fp8_out):
                    y = cute.where(y > FP8_E4M3_MAX, FP8_E4M3_MAX, y)
                    y = cute.where(y < -FP8_E4M3_MAX, -FP8_E4M3_MAX, y)
                g_out[col, None].store(y.to(out_t))

    @dsl.jit
    def launch(
        x: Any,
        residual: Any,
        weight: Any,
        out: Any,
        residual_out: Any,
        scale: Any,
        num_rows: Any,
        hidden: Any,
        eps: Any,
    ) -> None:
        add_rmsnorm_kernel(x, residual, weight, out, residual_out, scale, hidden, eps).launch(
            grid=[num_rows, 1, 1], block=[geo.threads, 1, 1], smem=geo.smem_bytes
        )

    args = (
        dsl.gmem_ptr(dtype_name, 16),
        dsl.gmem_ptr(dtype_name, 16),
        dsl.gmem_ptr(dtype_name, 16),
        dsl.gmem_ptr(out_name, 16),
        dsl.gmem_ptr(dtype_name, 16),
        dsl.gmem_ptr("fp32", 4),
        dsl.Int32(1),
        dsl.Int32(4096),
        dsl.Float32(1e-6),
    )
    return launch, args
