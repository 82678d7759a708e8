"""How far an output may be from the exact value: in steps of its format, set by torch.

A kernel's output is compared with the float64 reference (the exact value), and so is a
same-precision torch implementation's (the reference run in fp32 and rounded once to the
output format, what a correct implementation is expected to make). Errors are counted
in *steps*: the spacing of the output format at the exact value (bf16: 2^-7 of the
binade, FP8 e4m3: 2^-3, subnormals at the format's smallest exponent). A check passes
when both hold (as flash-attention's tests bound a kernel by twice torch's error):

- worst error: ``max steps(kernel) <= max(2 * max steps(torch), 1)``: rounding to
  nearest is at most half a step off, so a correct kernel whose operation order flips
  one rounding to the other neighbour (under a step) passes, and an answer two steps off
  fails;
- rounding: the share of elements more than half a step off (not the nearest value) is
  at most ``2 * torch's share + FLIP_SHARE``: occasional flips pass, a kernel that
  truncates or rounds the wrong way throughout fails even though each error is under a
  step;
- bias: where the kernel's output differs from torch's (a flip to the other neighbour),
  the flips must not lean one way, up (an offset) or away from zero (a scale): their
  mean over all elements, in steps, is at most ``BIAS_STEPS`` (1e-4) plus four standard
  deviations of flip noise (``4 sqrt(flips) / n``). A systematic error of 5e-5 relative
  is 4e-4 to 8e-4 steps of FP8 e4m3: under a step everywhere, flipping ~0.05 % of
  elements (which the share check allows), but every flip the same way; it fails from
  ~100k elements on (1e-4 relative fails the share check too). fp32 reordering and
  ``rsqrt.approx`` (~1e-7 relative: at most ~3e-5 steps of bf16) pass.

Infinities must match exactly and NaN never passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BIAS_STEPS", "FLIP_SHARE", "FORMATS", "Format", "StepCheck", "check", "steps"]

# A correct kernel flips where its fp32 result and torch's straddle a rounding midpoint:
# a share of order 1e-5. Truncating flips about half of all elements.
FLIP_SHARE = 1e-3
# The mean one-sided lean of flips a kernel may have, in steps (see the module doc).
BIAS_STEPS = 1e-4


@dataclass(frozen=True, slots=True, kw_only=True)
class Format:
    """A floating-point output format: mantissa bits and smallest normal exponent."""

    name: str
    mantissa_bits: int
    min_exponent: int


FORMATS: dict[str, Format] = {
    "bf16": Format(name="bf16", mantissa_bits=7, min_exponent=-126),
    "fp16": Format(name="fp16", mantissa_bits=10, min_exponent=-14),
    "fp8_e4m3": Format(name="fp8_e4m3", mantissa_bits=3, min_exponent=-6),
    "fp32": Format(name="fp32", mantissa_bits=23, min_exponent=-126),
}


def _step(exact: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """(the step of ``fmt`` at each finite ``exact``, ``exact`` with non-finite as 0)."""
    w = exact.double()
    w0 = torch.where(torch.isfinite(w), w, 0.0)
    _, exponent = torch.frexp(w0)  # |w| = m * 2**exponent, m in [0.5, 1)
    binade = torch.clamp(exponent.double() - 1, min=float(fmt.min_exponent))
    return torch.pow(2.0, binade - fmt.mantissa_bits), w0


def steps(got: torch.Tensor, exact: torch.Tensor, fmt: Format) -> torch.Tensor:
    """``|got - exact|`` in steps of ``fmt`` at ``exact`` (float64; NaN where got is NaN,
    0 where both are the same infinity)."""
    g, w = got.double(), exact.double()
    finite = torch.isfinite(w)
    step, w0 = _step(w, fmt)
    err = (g - w0).abs() / step
    same_inf = (~finite) & (g == w)
    return torch.where(same_inf, 0.0, torch.where(finite, err, float("inf")))


@dataclass(frozen=True, slots=True, kw_only=True)
class StepCheck:
    """One output's check: its worst error and flip share, and torch's, in steps."""

    passed: bool
    max_steps: float
    torch_max_steps: float
    flip_share: float
    torch_flip_share: float
    bias_steps: float = 0.0
    allowed_bias_steps: float = BIAS_STEPS

    @property
    def allowed_steps(self) -> float:
        return max(2 * self.torch_max_steps, 1.0)

    def detail(self) -> str:
        return (
            f"{self.max_steps:.2f} steps (allowed {self.allowed_steps:.2f}), "
            f"{self.flip_share:.2e} not nearest (torch {self.torch_flip_share:.2e}), "
            f"flips lean {self.bias_steps:+.1e} steps (allowed {self.allowed_bias_steps:.1e})"
        )


def _lean(
    got: torch.Tensor, same_precision: torch.Tensor, exact: torch.Tensor, f: Format
) -> tuple[float, float]:
    """(the larger mean lean of the flips from torch's output, in steps: toward +inf (an
    offset) or away from zero (a scale); what flip noise allows)."""
    step, w0 = _step(exact, f)
    d = (got.double() - same_precision.double()) / step
    ok = torch.isfinite(d)
    d, sign = d[ok], torch.sign(w0[ok])
    n = max(d.numel(), 1)
    flipped = float((d != 0).sum())
    offset, scale = float(d.sum()) / n, float((d * sign).sum()) / n
    return max(offset, scale, key=abs), BIAS_STEPS + 4 * flipped**0.5 / n


def check(
    got: torch.Tensor, same_precision: torch.Tensor, exact: torch.Tensor, fmt: str
) -> StepCheck:
    """Check ``got`` against ``exact`` with the bound ``same_precision`` sets (see above)."""
    f = FORMATS[fmt]
    if got.shape != exact.shape:
        return StepCheck(
            passed=False,
            max_steps=float("inf"),
            torch_max_steps=0.0,
            flip_share=1.0,
            torch_flip_share=0.0,
        )
    mine = steps(got, exact, f).nan_to_num(nan=float("inf"))
    torch_steps = steps(same_precision, exact, f).nan_to_num(nan=float("inf"))
    n = max(mine.numel(), 1)
    worst = float(mine.max()) if mine.numel() else 0.0
    torch_worst = float(torch_steps.max()) if torch_steps.numel() else 0.0
    flips = float((mine > 0.5).sum()) / n
    torch_flips = float((torch_steps > 0.5).sum()) / n
    lean, allowed_lean = _lean(got, same_precision, exact, f)
    passed = (
        worst <= max(2 * torch_worst, 1.0)
        and flips <= 2 * torch_flips + FLIP_SHARE
        and abs(lean) <= allowed_lean
    )
    return StepCheck(
        passed=passed,
        max_steps=worst,
        torch_max_steps=torch_worst,
        flip_share=flips,
        torch_flip_share=torch_flips,
        bias_steps=lean,
        allowed_bias_steps=allowed_lean,
    )
