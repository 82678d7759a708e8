"""What an engine runs today in place of each kernel: the baselines a kernel is timed against.

For the fused add + RMSNorm, in order of weight: vLLM's own op
(``torch.ops._C.fused_add_rms_norm``, or ``fused_add_rms_norm_static_fp8_quant`` for FP8
output; what vLLM's CUDA ``RMSNorm`` calls), ``torch.compile`` of the reference (what
vLLM's compiled graphs fuse the native op into), vLLM's ``forward_native`` order
(``reference.vllm_native_order``, on every device), and the eager reference.

``torch.compile`` is compiled afresh for each case (``compiled_reference``): dynamo's
caches are reset first, since each case's shape would otherwise be one more recompile of
the same function, and past dynamo's recompile limit (8) it would run eagerly under the
compiled label; ``fullgraph=True`` makes any such fallback an error, recorded as the
baseline's error. A baseline that cannot be built or run here is recorded with its error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kernels import reference

__all__ = ["RmsNormCall", "compiled_reference", "rmsnorm_baselines"]

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


def compiled_reference(backend: str = "inductor") -> RmsNormCall:
    """``torch.compile`` of the reference for one case: dynamo reset, one graph, no
    eager fallback (``fullgraph=True``: a graph break or the recompile limit raises)."""
    torch._dynamo.reset()
    compiled: RmsNormCall = torch.compile(
        reference.fused_add_rmsnorm, dynamic=False, fullgraph=True, backend=backend
    )
    return compiled


def rmsnorm_baselines(device: torch.device) -> dict[str, RmsNormCall]:
    """``{name: call}`` of every baseline available on ``device`` (build this per case:
    ``torch_compile`` is compiled afresh)."""
    out: dict[str, RmsNormCall] = {
        "torch": reference.fused_add_rmsnorm,
        "vllm_native_order": reference.vllm_native_order,
    }
    if device.type != "cuda":
        return out
    vllm_op = _vllm_rmsnorm()
    if vllm_op is not None:
        out["vllm"] = vllm_op
    out["torch_compile"] = compiled_reference()
    return out
