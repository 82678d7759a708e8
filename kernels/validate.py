"""Run every case in scope against the exact reference, and time it against the baselines.

For each ``RmsNormCase`` the new residual must be bit-exact (it is one rounding of an
exact sum) and the normed output must pass ``kernels.tolerance.check``: its error against
the float64 reference, in steps of the output format, bounded by what the same-precision
torch reference makes (``kernels.tolerance``).

Each baseline an engine would run instead (``kernels.baselines``: vLLM's op,
``torch.compile`` of the reference compiled for the case, vLLM's ``forward_native``
order, the eager reference) is put through the same check, and its own error recorded
(``CaseResult.baselines``: steps, share not nearest, lean, whether it meets the bar, or
the error that stopped it). On a GPU each case is also timed
(``kernels.timing.time_cuda``: CUDA graphs, warm-up, median and spread) for the kernel
and for each baseline.

Inputs (``RmsNormCase.inputs``): ``normal`` rows; ``saturating`` (FP8 out with a scale
small enough that ~7 % of outputs clamp to ±448); ``outliers`` (four channels of the
residual at 256 or more, ~100 times the rest, as in LLM activations: the RMS is
theirs).

The harness takes the implementation under test as an argument (``Impl``), so its
plumbing is tested on CPU with the references, the emulated kernels
(``kernels.emulate``) and broken copies of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from kernels import reference
from kernels.baselines import RmsNormCall, rmsnorm_baselines
from kernels.scope import SCOPES, RmsNormCase, ValidationCase
from kernels.timing import time_cuda
from kernels.tolerance import check

__all__ = [
    "EPS",
    "CaseResult",
    "Impl",
    "ReferenceImpl",
    "all_cases",
    "main",
    "run_case",
    "run_cases",
]

EPS = 1e-6
# Channels of the "outliers" rows that carry most of the RMS (any hidden size in scope).
OUTLIER_CHANNELS = [3, 100, 1031, 4095]
# FP8 scale of the "saturating" cases: |y| / scale over 448 for |y| > 1.8 (~7 %).
SATURATING_SCALE = 0.004


class Impl(Protocol):
    """What a validation run exercises: the kernels (``kernels.ops.Kernels``) or a stand-in."""

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
    """The torch reference as an ``Impl``: the stock path, and the CPU stand-in."""

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
    max_steps: float  # worst error of the output, in steps of its format
    allowed_steps: float  # the bound the same-precision torch reference set
    detail: str  # "ok", or which check failed; then the numbers
    kernel_us: float | None = None  # median under CUDA graphs
    timings: dict[str, dict[str, object]] = field(default_factory=dict)
    baselines: dict[str, dict[str, object]] = field(default_factory=dict)  # their own errors

    @property
    def stock_us(self) -> float | None:
        """The fastest baseline's median: what the kernel has to beat."""
        medians = [
            float(t["median_us"])  # type: ignore[arg-type]
            for name, t in self.timings.items()
            if name != "kernel" and "median_us" in t
        ]
        return min(medians) if medians else None

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def all_cases() -> tuple[ValidationCase, ...]:
    return tuple(case for scope in SCOPES for case in scope.cases())


def _inputs(
    case: RmsNormCase, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = reference.torch_dtype(case.dtype)
    t, hidden = case.batch, case.hidden_size

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    x = randn(t, hidden).to(dtype)
    residual = 4 * randn(t, hidden)
    if case.inputs == "outliers":
        r = residual[:, OUTLIER_CHANNELS]
        residual[:, OUTLIER_CHANNELS] = torch.where(r < 0, -1.0, 1.0) * (256 + 64 * r.abs())
    residual = residual.to(dtype)
    weight = (1 + 0.1 * randn(hidden)).to(dtype)
    fp8_scale = SATURATING_SCALE if case.inputs == "saturating" else 0.05
    scale = torch.tensor([fp8_scale], device=device) if case.out_dtype == "fp8_e4m3" else None
    return x, residual, weight, scale


def _bound(
    call: RmsNormCall, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, scale: Any
) -> Callable[[], object]:
    """``call`` on its own copies of the inputs (vLLM's op writes them in place)."""
    return lambda: call(x, residual, weight, EPS, scale)


def _normed(out: object) -> torch.Tensor:
    """A baseline's normed output (the references return ``(normed, new_residual)``)."""
    return out[0] if isinstance(out, tuple) else out  # type: ignore[return-value]


def _baseline_errors(
    baselines: dict[str, RmsNormCall],
    case: RmsNormCase,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
    torch_out: torch.Tensor,
    exact: torch.Tensor,
) -> dict[str, dict[str, object]]:
    """Each baseline's own error against the exact value, by the kernels' check."""
    x, residual, weight, scale = inputs
    out: dict[str, dict[str, object]] = {}
    for name, call in baselines.items():
        try:
            normed = _normed(call(x.clone(), residual.clone(), weight, EPS, scale))
        except Exception as exc:  # recorded: this baseline did not run
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        c = check(normed, torch_out, exact, case.out_dtype)
        out[name] = {
            "passed": c.passed,
            "max_steps": c.max_steps,
            "not_nearest": c.flip_share,
            "lean_steps": c.bias_steps,
        }
    return out


def _timings(
    impl: Impl,
    baselines: dict[str, RmsNormCall],
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
) -> dict[str, dict[str, object]]:
    x, residual, weight, scale = inputs
    kernel = time_cuda(lambda: impl.fused_add_rmsnorm(x, residual, weight, EPS, scale))
    out: dict[str, dict[str, object]] = {"kernel": kernel.to_json()}
    for name, call in baselines.items():
        try:
            out[name] = time_cuda(
                _bound(call, x.clone(), residual.clone(), weight, scale)
            ).to_json()
        except Exception as exc:  # recorded: this baseline was not timed
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def _run_rmsnorm(
    case: RmsNormCase, impl: Impl, device: torch.device, seed: int, timing: bool
) -> CaseResult:
    inputs = _inputs(case, device, seed)
    x, residual, weight, scale = inputs
    normed, new_residual = impl.fused_add_rmsnorm(x, residual, weight, EPS, scale)
    torch_out, want_residual = reference.fused_add_rmsnorm(x, residual, weight, EPS, scale)
    exact, _ = reference.fused_add_rmsnorm(
        x.double(), residual, weight.double(), EPS, scale, out_dtype=torch.float64
    )
    normed_check = check(normed, torch_out, exact, case.out_dtype)
    failed = []
    if not torch.equal(new_residual, want_residual):
        failed.append("new residual bit-exact")
    if not normed_check.passed:
        failed.append("normed vs exact")
    baselines = rmsnorm_baselines(device)  # torch.compile afresh for this case
    errors = _baseline_errors(baselines, case, inputs, torch_out, exact)
    timings = _timings(impl, baselines, inputs) if timing else {}
    kernel_us = timings.get("kernel", {}).get("median_us")
    return CaseResult(
        case_id=case.case_id,
        kernel=case.kernel,
        passed=not failed,
        max_steps=normed_check.max_steps,
        allowed_steps=normed_check.allowed_steps,
        detail=("ok" if not failed else "failed: " + ", ".join(failed))
        + f" ({normed_check.detail()})",
        kernel_us=None if kernel_us is None else float(kernel_us),  # type: ignore[arg-type]
        timings=timings,
        baselines=errors,
    )


def run_case(
    case: ValidationCase, impl: Impl, device: torch.device, seed: int = 0, timing: bool = False
) -> CaseResult:
    """Check one case (and time it when ``timing``, which needs a CUDA device)."""
    try:
        return _run_rmsnorm(case, impl, device, seed, timing)
    except Exception as exc:
        # A refused or failed launch, a driver or compiler error: a failed case, recorded
        # with its type and message; the next case still runs.
        return CaseResult(
            case_id=case.case_id,
            kernel=case.kernel,
            passed=False,
            max_steps=float("nan"),
            allowed_steps=float("nan"),
            detail=f"error: {type(exc).__name__}: {exc}",
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
    """``validate``, ``show``, ``diff``, ``compile``, ``ab``: the commands of ``kernels.cli``."""
    from kernels.cli import main as cli_main

    return cli_main(argv)
