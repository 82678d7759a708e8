"""Run every case in scope against the torch reference, and time it against the stock path.

For each ``CombineCase`` the partials come from real DCP-sharded attention
(``reference.dcp_partials``), rounded to the case's dtype as an engine would hand them
over; the kernel's output must match both the reference combine of those partials and
unsharded attention, within the dtype's tolerance. Empty shards, ``seq_len < ranks`` and
all-empty rows report NaN partials and ±inf LSEs (``poison_empty``). For each
``RmsNormCase`` the new residual must be bit-exact and the normed output within tolerance.

On a GPU each case is also timed (warm-up, then the median of per-call CUDA-event times)
for the kernel and for the stock path: the same torch reference on the GPU, which is what
an engine runs without the kernel.

The harness takes the implementation under test as an argument (``Impl``), so its
plumbing is tested on CPU with the references themselves, or a broken copy of them.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from kernels import reference
from kernels.scope import SCOPES, CombineCase, RmsNormCase, ValidationCase

__all__ = [
    "TOLERANCES",
    "CaseResult",
    "Impl",
    "ReferenceImpl",
    "all_cases",
    "main",
    "run_case",
    "run_cases",
    "time_us",
]

# (atol, rtol) per output dtype: |got - want| <= atol + rtol * |want| elementwise.
# bf16/fp16: about one unit in the last place at |x| ~ 1-4; fp8 e4m3: one of its 3-bit
# mantissa steps; LSE (fp32, through ex2/lg2.approx): well under 1e-4 at |lse| < 100.
TOLERANCES: dict[str, tuple[float, float]] = {
    "bf16": (1e-2, 1.6e-2),
    "fp16": (1e-3, 2e-3),
    "fp8_e4m3": (2e-2, 7e-2),
    "lse": (1e-4, 1e-5),
}
EPS = 1e-6


class Impl(Protocol):
    """What a validation run exercises: the kernels (``kernels.ops.Kernels``) or a stand-in."""

    def lse_combine(
        self, partials: torch.Tensor, lses: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def fused_add_rmsnorm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        scale: torch.Tensor | None = None,
        inplace: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class ReferenceImpl:
    """The torch references as an ``Impl``: the stock path, and the CPU stand-in."""

    def lse_combine(
        self, partials: torch.Tensor, lses: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.lse_combine(partials, lses)

    def fused_add_rmsnorm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        scale: torch.Tensor | None = None,
        inplace: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.fused_add_rmsnorm(x, residual, weight, eps, scale)


@dataclass(frozen=True, slots=True, kw_only=True)
class CaseResult:
    case_id: str
    kernel: str
    passed: bool
    max_abs_err: float  # worst over the case's outputs, against the reference
    detail: str  # which check failed, or "ok"
    kernel_us: float | None = None
    stock_us: float | None = None

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def all_cases() -> tuple[ValidationCase, ...]:
    return tuple(case for scope in SCOPES for case in scope.cases())


def _close(got: torch.Tensor, want: torch.Tensor, tol: str) -> tuple[bool, float]:
    """Elementwise check; infinities must match exactly, and NaN never passes."""
    atol, rtol = TOLERANCES[tol]
    g, w = got.double(), want.double()
    if g.shape != w.shape:
        return False, float("inf")
    inf_w = torch.isinf(w)
    infs_match = bool((g[inf_w] == w[inf_w]).all())
    err = (g - w).abs().masked_fill(inf_w, 0.0)  # NaN in got stays NaN and fails below
    within = bool((err <= atol + rtol * w.abs().masked_fill(inf_w, 0.0)).all())
    worst = float(err.nan_to_num(nan=float("inf")).max()) if err.numel() else 0.0
    return infs_match and within, worst


def time_us(fn: Callable[[], object], warmup: int = 10, repeats: int = 50) -> float:
    """Median microseconds per call of ``fn`` on the current CUDA stream."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) * 1e3)
    return float(statistics.median(times))


def _combine_inputs(
    case: CombineCase, device: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(partials, lses, unsharded out, unsharded lse) for a case."""
    n, b, h, d = case.num_ranks, case.batch, case.num_heads, case.head_dim
    tokens = max(2 * n, 32)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    q, k, v = randn(b, h, d), randn(b, tokens, h, d), randn(b, tokens, h, d)
    low, high = {"full": (n, tokens), "empty_rank": (n, tokens), "short_seq": (1, n - 1)}.get(
        case.shards, (0, 0)
    )
    seq_lens = torch.randint(low, high + 1, (b,), generator=gen).to(device)
    positions = torch.arange(tokens, device=device)
    valid = positions[None, :] < seq_lens[:, None]
    if case.shards == "empty_rank":
        valid &= (positions % n != 0)[None, :]
    partials, lses = reference.dcp_partials(q, k, v, valid, n, poison_empty=True)
    want_out, want_lse = reference.attention_with_lse(q, k, v, valid)
    return partials.to(reference.torch_dtype(case.dtype)), lses, want_out, want_lse


def _run_combine(
    case: CombineCase, impl: Impl, device: torch.device, gen: torch.Generator, timing: bool
) -> CaseResult:
    partials, lses, unsharded, unsharded_lse = _combine_inputs(case, device, gen)
    out, lse = impl.lse_combine(partials, lses)
    want, want_lse = reference.lse_combine(partials, lses)
    checks = [
        ("output vs reference combine", *_close(out, want, case.dtype)),
        ("lse vs reference combine", *_close(lse, want_lse, "lse")),
        ("output vs unsharded attention", *_close(out, unsharded, case.dtype)),
        ("lse vs unsharded attention", *_close(lse, unsharded_lse, "lse")),
    ]
    kernel_us = stock_us = None
    if timing:
        kernel_us = time_us(lambda: impl.lse_combine(partials, lses))
        stock_us = time_us(lambda: reference.lse_combine(partials, lses))
    return _result(case, checks, kernel_us, stock_us)


def _run_rmsnorm(
    case: RmsNormCase, impl: Impl, device: torch.device, gen: torch.Generator, timing: bool
) -> CaseResult:
    dtype = reference.torch_dtype(case.dtype)
    t, hidden = case.batch, case.hidden_size
    x = torch.randn(t, hidden, generator=gen).to(device, dtype)
    residual = (4 * torch.randn(t, hidden, generator=gen)).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
    scale = None
    if case.out_dtype == "fp8_e4m3":
        scale = torch.tensor([0.05], device=device)
    normed, new_residual = impl.fused_add_rmsnorm(x, residual, weight, EPS, scale)
    want, want_residual = reference.fused_add_rmsnorm(x, residual, weight, EPS, scale)
    exact = bool(torch.equal(new_residual, want_residual))
    checks = [
        ("new residual bit-exact", exact, float((new_residual - want_residual).abs().max())),
        ("normed vs reference", *_close(normed.float(), want.float(), case.out_dtype)),
    ]
    kernel_us = stock_us = None
    if timing:
        kernel_us = time_us(lambda: impl.fused_add_rmsnorm(x, residual, weight, EPS, scale))
        stock_us = time_us(lambda: reference.fused_add_rmsnorm(x, residual, weight, EPS, scale))
    return _result(case, checks, kernel_us, stock_us)


def _result(
    case: ValidationCase,
    checks: list[tuple[str, bool, float]],
    kernel_us: float | None,
    stock_us: float | None,
) -> CaseResult:
    failed = [name for name, ok, _ in checks if not ok]
    return CaseResult(
        case_id=case.case_id,
        kernel=case.kernel,
        passed=not failed,
        max_abs_err=max(err for _, _, err in checks),
        detail="ok" if not failed else "failed: " + ", ".join(failed),
        kernel_us=kernel_us,
        stock_us=stock_us,
    )


def run_case(
    case: ValidationCase, impl: Impl, device: torch.device, seed: int = 0, timing: bool = False
) -> CaseResult:
    """Check one case (and time it when ``timing``, which needs a CUDA device)."""
    gen = torch.Generator().manual_seed(seed)
    try:
        if isinstance(case, CombineCase):
            return _run_combine(case, impl, device, gen, timing)
        return _run_rmsnorm(case, impl, device, gen, timing)
    except (ValueError, RuntimeError) as exc:
        # A refused or failed launch is a failed case, recorded with its message.
        return CaseResult(
            case_id=case.case_id,
            kernel=case.kernel,
            passed=False,
            max_abs_err=float("nan"),
            detail=f"error: {exc}",
        )


def run_cases(
    cases: Iterable[ValidationCase],
    impl: Impl,
    device: torch.device,
    timing: bool | None = None,
    progress: Callable[[CaseResult], None] | None = None,
) -> list[CaseResult]:
    """Every case, in order; ``timing`` defaults to "on a CUDA device"."""
    timed = device.type == "cuda" if timing is None else timing
    results = []
    for i, case in enumerate(cases):
        result = run_case(case, impl, device, seed=i, timing=timed)
        results.append(result)
        if progress is not None:
            progress(result)
    return results


def main(argv: list[str] | None = None) -> int:
    """``validate``, ``show``, ``diff``, ``compile``: the same commands as ``kernels.cli``."""
    from kernels.cli import main as cli_main

    return cli_main(argv)
