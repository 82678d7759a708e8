"""The torch references define the kernels: check them against first principles.

The DCP combine must turn per-rank attention over an interleaved KV shard back into
attention over the whole sequence, including ranks that saw no token; the fused norm must
equal the plain arithmetic spelled out element by element.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels import reference


def _attention_case(
    b: int, h: int, d: int, t: int, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, d, generator=gen, dtype=dtype)
    k = torch.randn(b, t, h, d, generator=gen, dtype=dtype)
    v = torch.randn(b, t, h, d, generator=gen, dtype=dtype)
    seq_lens = torch.randint(0, t + 1, (b,), generator=gen)
    valid = torch.arange(t)[None, :] < seq_lens[:, None]
    return q, k, v, valid


@pytest.mark.parametrize(
    ("num_ranks", "d", "seed"),
    list(itertools.product([2, 4, 8, 16], [128, 512], [0, 1])),
)
def test_sharded_attention_merged_equals_unsharded_fp32(num_ranks: int, d: int, seed: int) -> None:
    # Random batch/heads/lengths, lengths from 0 (all ranks empty) up to the whole buffer;
    # many rows have seq_len < num_ranks, so some ranks saw nothing.
    gen = torch.Generator().manual_seed(100 + seed)
    b, h, t = (int(x) for x in torch.randint(1, 6, (3,), generator=gen) * torch.tensor([1, 1, 9]))
    q, k, v, valid = _attention_case(b, h, d, t, seed)
    partials, lses = reference.dcp_partials(q, k, v, valid, num_ranks)
    out, lse = reference.lse_combine(partials, lses)
    want, want_lse = reference.attention_with_lse(q, k, v, valid)
    assert torch.allclose(out, want, atol=1e-6, rtol=0)
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(lse), empty)
    assert torch.allclose(lse[~empty], want_lse[~empty], atol=1e-6, rtol=0)
    assert torch.all(out[empty] == 0)


def test_bf16_partials_merge_within_a_bf16_step_of_fp32_attention() -> None:
    q, k, v, valid = _attention_case(4, 8, 128, 40, seed=3)
    partials, lses = reference.dcp_partials(q, k, v, valid, 8)
    out, _ = reference.lse_combine(partials.to(torch.bfloat16), lses)
    want, _ = reference.attention_with_lse(q, k, v, valid)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), want, atol=1e-2, rtol=1.6e-2)


def test_empty_ranks_report_garbage_and_are_ignored() -> None:
    # seq_len 3 on 8 ranks: ranks 3..7 saw nothing and report NaN outputs with -inf or
    # +inf LSEs (FA3 and FA2 conventions); none of it may reach the merged output.
    q, k, v, _ = _attention_case(2, 4, 128, 16, seed=5)
    valid = torch.arange(16)[None, :] < torch.tensor([3, 0])[:, None]
    partials, lses = reference.dcp_partials(q, k, v, valid, 8, poison_empty=True)
    assert torch.isnan(partials[3:, 0]).all() and torch.isinf(lses[3:, 0]).all()
    assert (lses[3:, 0] > 0).any(), "some empty ranks report +inf"
    out, lse = reference.lse_combine(partials, lses)
    want, want_lse = reference.attention_with_lse(q, k, v, valid)
    assert torch.allclose(out[0], want[0], atol=1e-6)
    # Row 1 has no token at all: output 0 and LSE -inf, not NaN.
    assert torch.all(out[1] == 0)
    assert torch.all(lse[1] == float("-inf"))
    assert torch.allclose(lse[0], want_lse[0], atol=1e-6)


def test_nan_lse_counts_as_an_empty_rank() -> None:
    partials = torch.ones(2, 1, 1, 128)
    partials[1] = 5.0
    lses = torch.tensor([[[0.0]], [[float("nan")]]])
    out, lse = reference.lse_combine(partials, lses)
    assert torch.all(out == 1.0) and lse.item() == 0.0


def test_combine_returns_the_merged_lse_of_equal_ranks() -> None:
    # Two ranks with equal LSEs: weights 1/2 each, merged LSE = lse + ln 2.
    partials = torch.stack([torch.zeros(1, 1, 128), torch.ones(1, 1, 128)])
    lses = torch.full((2, 1, 1), 1.5)
    out, lse = reference.lse_combine(partials, lses)
    assert torch.allclose(out, torch.full_like(out, 0.5))
    assert lse.item() == pytest.approx(1.5 + torch.log(torch.tensor(2.0)).item())


def test_combine_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"\[N, B, H, D\]"):
        reference.lse_combine(torch.zeros(2, 1, 1, 8), torch.zeros(2, 1))


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
