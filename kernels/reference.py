"""Torch references for the specialised kernels; they define what a kernel must compute.

Every function here runs on CPU and on GPU, in fp32 (or fp64 when given fp64 inputs), and
is what ``kernels.validate`` compares a kernel with and times as the stock path.

- ``lse_combine``: the DCP merge. A rank's LSE that is -inf, +inf or NaN means the rank saw
  no token (FlashAttention 2 reports +inf there, FlashAttention 3 -inf): its weight is 0
  and its partial output is never read into the sum, so garbage there cannot leak. When no
  rank saw a token the output is 0 and the merged LSE is -inf.
- ``fused_add_rmsnorm``: ``residual = x + residual`` rounded to the model dtype (what the
  next layer reads), then RMSNorm of that rounded residual in fp32, times the weight, and
  one rounding at the end (or FP8 e4m3 of ``y / scale``, clamped to ±448).
- ``attention_with_lse`` / ``dcp_partials``: single-query attention and its DCP-sharded
  form (token ``t`` lives on rank ``t % N``), to check the combine end to end.
"""

from __future__ import annotations

import torch

__all__ = [
    "FP8_E4M3_MAX",
    "attention_with_lse",
    "dcp_partials",
    "fused_add_rmsnorm",
    "lse_combine",
    "torch_dtype",
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


def lse_combine(
    partials: torch.Tensor, lses: torch.Tensor, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``partials [N, B, H, D]`` with natural-log ``lses [N, B, H]``.

    Returns ``(out [B, H, D]`` in ``out_dtype`` (default: the partials' dtype),
    ``lse [B, H]`` in the math dtype).
    """
    if partials.dim() != 4 or lses.shape != partials.shape[:3]:
        raise ValueError(
            f"expected partials [N, B, H, D] and lses [N, B, H]; got {tuple(partials.shape)} "
            f"and {tuple(lses.shape)}"
        )
    math = _math_dtype(partials)
    lse = lses.to(math)
    lse = torch.where(torch.isnan(lse) | (lse == float("inf")), float("-inf"), lse)
    lse_max = lse.amax(dim=0)
    # Only when every rank is empty is the max -inf; 0 keeps exp() finite there.
    lse_max = torch.where(torch.isinf(lse_max), 0.0, lse_max)
    weights = torch.exp(lse - lse_max)  # [N, B, H]; empty ranks → exactly 0
    total = weights.sum(dim=0)
    w = weights.unsqueeze(-1)
    contrib = torch.where(w > 0, partials.to(math) * w, 0.0)
    denom = torch.where(total > 0, total, 1.0).unsqueeze(-1)
    out = contrib.sum(dim=0) / denom
    merged = torch.where(total > 0, lse_max + torch.log(total), float("-inf"))
    return out.to(out_dtype or partials.dtype), merged


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, new_residual)`` for ``x, residual [T, hidden]`` and ``weight [hidden]``.

    With ``scale`` (a one-element fp32 tensor), ``normed`` is FP8 e4m3 of ``y / scale``.
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
        return y.to(x.dtype), new_residual
    q = (y / scale.to(math)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn), new_residual


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-query attention over the tokens ``mask`` keeps, with its LSE.

    ``q [B, H, D]``, ``k, v [B, T, H, D]``, ``mask [B, T]`` (bool). Scale ``1/sqrt(D)``.
    Returns ``(out [B, H, D], lse [B, H])`` in the math dtype; a row with no token gets
    output 0 and LSE -inf.
    """
    math = _math_dtype(q)
    scores = torch.einsum("bhd,bthd->bht", q.to(math), k.to(math)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H]; -inf for an empty row
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("bht,bthd->bhd", probs, v.to(math))
    return out, lse


def dcp_partials(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor,
    num_ranks: int,
    poison_empty: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``num_ranks`` DCP ranks compute over the tokens ``valid [B, T]`` keeps: token
    ``t`` lives on rank ``t % num_ranks``. Returns ``(partials [N, B, H, D], lses [N, B, H])``.

    With ``poison_empty``, a rank that saw no token reports NaN outputs and alternates
    -inf / +inf LSEs, as real attention backends may: the combine must ignore them.
    """
    positions = torch.arange(k.shape[1], device=k.device)
    outs, lses = [], []
    for rank in range(num_ranks):
        mask = valid & (positions % num_ranks == rank)[None, :]
        out, lse = attention_with_lse(q, k, v, mask)
        if poison_empty:
            empty = torch.isinf(lse)
            out = torch.where(empty[..., None], float("nan"), out)
            lse = torch.where(empty, float("inf") if rank % 2 else float("-inf"), lse)
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)
