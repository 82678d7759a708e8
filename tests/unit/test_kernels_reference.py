"""The torch references define the kernels: check them against first principles.

The fused norm must equal the plain arithmetic spelled out element by element, and its
float64 form (``out_dtype=torch.float64``) is the exact value, unrounded.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference


def _naive_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row in Python floats; rounding to the model dtype where the spec says."""
    normed, new_residual = torch.empty_like(x), torch.empty_like(residual)
    for i in range(x.shape[0]):
        sums = [a + r for a, r in zip(x[i].tolist(), residual[i].tolist(), strict=True)]
        new_residual[i] = torch.tensor(sums, dtype=torch.float64).to(x.dtype)
        z = new_residual[i].tolist()
        inv = (sum(e * e for e in z) / len(z) + eps) ** -0.5
        y = [e * inv * w for e, w in zip(z, weight.tolist(), strict=True)]
        normed[i] = torch.tensor(y, dtype=torch.float64).to(x.dtype)
    return normed, new_residual


@pytest.mark.parametrize("hidden", [4096, 7168])
def test_fused_add_rmsnorm_matches_naive(hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(3, hidden, generator=gen).to(torch.bfloat16)
    residual = (4 * torch.randn(3, hidden, generator=gen)).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16)
    normed, new_residual = reference.fused_add_rmsnorm(x, residual, weight, 1e-6)
    want, want_residual = _naive_add_rmsnorm(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, want_residual)
    # One rounding at the end in both: they may differ by one bf16 step at most.
    assert torch.allclose(normed.float(), want.float(), atol=0, rtol=2**-7)


def test_fused_add_rmsnorm_fp8_output_is_scaled_and_clamped() -> None:
    x = torch.tensor([[1.0, -1.0, 3.0, 0.5] * 1024], dtype=torch.bfloat16)
    residual = torch.zeros_like(x)
    weight = torch.ones(4096, dtype=torch.bfloat16)
    weight[2] = 1000.0  # pushes one element past the e4m3 range
    scale = torch.tensor([0.5])
    normed, _ = reference.fused_add_rmsnorm(x, residual, weight, 1e-6, scale)
    bf16, _ = reference.fused_add_rmsnorm(x, residual, weight, 1e-6)
    assert normed.dtype == torch.float8_e4m3fn
    assert normed.float()[0, 2].item() == reference.FP8_E4M3_MAX
    want = (bf16.float()[0, :2] / 0.5).to(torch.float8_e4m3fn).float()
    assert torch.allclose(normed.float()[0, :2], want, rtol=0.07)


def test_the_float64_reference_is_the_exact_value_the_output_rounds() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 4096, generator=gen).to(torch.bfloat16)
    residual = torch.randn(4, 4096, generator=gen).to(torch.bfloat16)
    weight = torch.ones(4096, dtype=torch.bfloat16)
    exact, new_residual = reference.fused_add_rmsnorm(
        x.double(), residual, weight.double(), 1e-6, out_dtype=torch.float64
    )
    assert exact.dtype == torch.float64 and new_residual.dtype == torch.bfloat16
    normed, _ = reference.fused_add_rmsnorm(x, residual, weight, 1e-6)
    # Rounding the exact value to bf16 is the fp32 reference but for near-midpoint ties.
    assert float((exact.to(torch.bfloat16) != normed).float().mean()) < 1e-3
