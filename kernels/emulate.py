"""The kernels' operation order, emulated in torch on CPU: one more implementation to check.

A CuTe kernel cannot run without a GPU, but its arithmetic can be replayed: the same
fp32 operations in the same order, the same roundings. ``Emulated`` is an ``Impl`` for
``kernels.validate``, so the CPU tests put the kernels' rounding and indexing through the
same tolerance rule a GPU run uses.

``fused_add_rmsnorm`` follows ``kernels/cute/add_rmsnorm.py``: thread ``t`` of a 256-thread
CTA owns the 8-element vectors ``t, t + 256, t + 512, t + 768`` of its row; it adds ``x``
and ``residual`` in fp32, rounds to bf16 (the new residual) and sums the squares of the
rounded values (vector by vector, each vector's 8 squares left to right); a warp sums its
lanes by butterfly shuffles (xor 16, 8, 4, 2, 1), the CTA its 8 warps' slots in order;
``inv = rsqrt(total / hidden + eps)`` (for FP8 then ``inv / scale``); ``y = z * inv * w``;
clamped to ±448 and rounded once. ``rsqrt`` here is exact fp32 where the kernel's
``rsqrt.approx`` may differ in the last bit.
"""

from __future__ import annotations

import torch

from kernels.cute.add_rmsnorm import FP8_E4M3_MAX, THREADS, VEC, VECS_PER_THREAD, WARPS

__all__ = ["Emulated", "fused_add_rmsnorm"]


def _butterfly(lanes: torch.Tensor) -> torch.Tensor:
    """Warp sum by xor shuffles over the last dim (32 lanes); every lane ends with it."""
    index = torch.arange(32)
    for offset in (16, 8, 4, 2, 1):
        lanes = lanes + lanes[..., index ^ offset]
    return lanes


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, new_residual)`` as the CuTe kernel computes them (bf16 inputs)."""
    tokens, hidden = x.shape
    f32 = torch.float32
    new_residual = (x.to(f32) + residual.to(f32)).to(residual.dtype)
    z = new_residual.to(f32)
    padded = torch.zeros(tokens, VECS_PER_THREAD * THREADS * VEC, dtype=f32)
    padded[:, :hidden] = z  # zeros past the row add exactly nothing
    squares = (padded * padded).view(tokens, VECS_PER_THREAD, THREADS, VEC)
    per_vector = torch.zeros(tokens, VECS_PER_THREAD, THREADS, dtype=f32)
    for e in range(VEC):
        per_vector = per_vector + squares[..., e]
    per_thread = torch.zeros(tokens, THREADS, dtype=f32)
    for v in range(VECS_PER_THREAD):
        per_thread = per_thread + per_vector[:, v]
    per_warp = _butterfly(per_thread.view(tokens, WARPS, 32))[..., 0]
    total = torch.zeros(tokens, dtype=f32)
    for w in range(WARPS):
        total = total + per_warp[:, w]
    inv = torch.rsqrt(total / torch.tensor(hidden, dtype=f32) + torch.tensor(eps, dtype=f32))
    if scale is not None:
        inv = inv / scale.to(f32).reshape(())
    y = z * inv[:, None] * weight.to(f32)
    if scale is None:
        return y.to(x.dtype), new_residual
    y = y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return y.to(torch.float8_e4m3fn), new_residual


class Emulated:
    """The emulated kernels as a ``kernels.validate.Impl``."""

    def fused_add_rmsnorm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        scale: torch.Tensor | None = None,
        inplace: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cpu_scale = None if scale is None else scale.cpu()
        normed, new_residual = fused_add_rmsnorm(
            x.cpu(), residual.cpu(), weight.cpu(), eps, cpu_scale
        )
        return normed.to(x.device), new_residual.to(x.device)
