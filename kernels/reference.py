"""Torch references for the specialised kernels; they define what a kernel must compute.

Every function here runs on CPU and on GPU, in fp32 (or fp64 when given fp64 inputs), and
is what ``kernels.validate`` compares a kernel with and times as the stock path.

- ``fused_add_rmsnorm``: ``residual = x + residual`` rounded to the model dtype (what the
  next layer reads), then RMSNorm of that rounded residual in fp32, times the weight, and
  one rounding at the end (or FP8 e4m3 of ``y / scale``, clamped to ±448). With
  ``out_dtype=torch.float64`` and fp64 inputs it is the exact value the validation
  measures every implementation's error against.
- ``vllm_native_order``: vLLM's ``RMSNorm.forward_native`` with a residual
  (``vllm.ir.ops.layernorm.fused_add_rms_norm``): the variance of the unrounded fp32
  sum, the normalised value rounded to bf16 and then multiplied by the bf16 weight (a
  second rounding), FP8 quantised from that bf16 output (a third). vLLM's CUDA op also
  rounds the normalised value before the weight. A baseline, not a reference: it fails
  the kernels' tolerance (``kernels.tolerance``), which the evidence records.
"""

from __future__ import annotations

import torch

__all__ = [
    "FP8_E4M3_MAX",
    "fused_add_rmsnorm",
    "torch_dtype",
    "vllm_native_order",
]

FP8_E4M3_MAX = 448.0

_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a scope's dtype name ("bf16", "fp16", "fp32", "fp8_e4m3")."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(_DTYPES)}") from None


def _math_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, new_residual)`` for ``x, residual [T, hidden]`` and ``weight [hidden]``.

    With ``scale`` (a one-element fp32 tensor), ``normed`` is FP8 e4m3 of ``y / scale``.
    ``out_dtype`` overrides the output's dtype (``torch.float64``: no rounding at all).
    The new residual is rounded to ``residual``'s dtype whatever the math dtype.
    """
    if x.shape != residual.shape or weight.shape != x.shape[-1:]:
        raise ValueError(
            f"expected x, residual [T, hidden] and weight [hidden]; got {tuple(x.shape)}, "
            f"{tuple(residual.shape)}, {tuple(weight.shape)}"
        )
    math = _math_dtype(x)
    new_residual = (x.to(math) + residual.to(math)).to(residual.dtype)
    z = new_residual.to(math)
    inv_rms = torch.rsqrt(z.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = z * inv_rms * weight.to(math)
    if scale is None:
        return y.to(out_dtype or x.dtype), new_residual
    q = (y / scale.to(math)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(out_dtype or torch.float8_e4m3fn), new_residual


def vllm_native_order(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, new_residual)`` in the order of vLLM's ``forward_native`` (see above);
    FP8 e4m3 of ``normed / scale`` (vLLM's static quantisation) with ``scale``."""
    z = x.float() + residual.float()
    new_residual = z.to(residual.dtype)
    variance = z.pow(2).mean(dim=-1, keepdim=True)
    normed = ((z * torch.rsqrt(variance + eps)).to(weight.dtype) * weight).to(x.dtype)
    if scale is None:
        return normed, new_residual
    q = (normed.float() / scale.float()).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn), new_residual
