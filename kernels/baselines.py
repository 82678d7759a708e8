"""What an engine runs today in place of each kernel: the baselines a kernel is timed against.

For the fused add + RMSNorm, in order of weight: vLLM's own op
(``torch.ops._C.fused_add_rms_norm``, or ``fused_add_rms_norm_static_fp8_quant`` for FP8
output; what vLLM's CUDA ``RMSNorm`` calls), ``torch.compile`` of the reference (what
vLLM's compiled graphs fuse the native op into), and the eager reference. A baseline
that cannot be built here (no vLLM GPU build, no compiler) is left out, and the evidence
says which were measured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kernels import reference

__all__ = ["RmsNormCall", "rmsnorm_baselines"]

RmsNormCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, Any], object]


def _vllm_rmsnorm() -> RmsNormCall | None:
    try:
        ops = torch.ops._C
        add_norm = ops.fused_add_rms_norm
        add_norm_fp8 = ops.fused_add_rms_norm_static_fp8_quant
    except (AttributeError, RuntimeError):
        try:
            import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

            add_norm = torch.ops._C.fused_add_rms_norm
            add_norm_fp8 = torch.ops._C.fused_add_rms_norm_static_fp8_quant
        except (ImportError, AttributeError, RuntimeError):
            return None

    def call(
        x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, scale: Any
    ) -> object:
        # In place, as vLLM calls it: the harness hands each baseline its own copies.
        if scale is None:
            add_norm(x, residual, w, eps)
            return x
        out = torch.empty_like(x, dtype=torch.float8_e4m3fn)
        add_norm_fp8(out, x, residual, w, scale, eps)
        return out

    return call


def rmsnorm_baselines(device: torch.device) -> dict[str, RmsNormCall]:
    """``{name: call}`` of every baseline available on ``device``."""
    out: dict[str, RmsNormCall] = {"torch": reference.fused_add_rmsnorm}
    if device.type != "cuda":
        return out
    vllm_op = _vllm_rmsnorm()
    if vllm_op is not None:
        out["vllm"] = vllm_op
    try:
        out["torch_compile"] = torch.compile(reference.fused_add_rmsnorm, dynamic=False)
    except RuntimeError:
        pass
    return out
