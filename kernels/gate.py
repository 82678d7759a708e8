"""Whether an engine may use each specialised decode path, and why. Pure.

``decide(engine)`` returns one ``PathDecision`` per path. kvtide's own kernels are enabled
only when the engine lies inside the kernel's declared scope (``kernels.scope``) AND
inside a validated scope: an entry of ``VALIDATED`` that names the evidence file a GPU
run wrote under ``kernels/evidence/``. With ``VALIDATED`` empty (no GPU evidence yet)
every kvtide kernel is refused with a reason that starts "no evidence".

vLLM's own Kimi K3 path (``additional_config={"decode_backend": "latency_specialized"}``,
in ``vllm/models/kimi_k3/nvidia/specialized_decode/``) is vLLM's to validate; the gate
applies vLLM's own limits so kvtide never asks for it where vLLM would refuse: Kimi K3
only, SM100/SM103, TP 8 or 16, DCP 1 or equal to TP, no pipeline or expert parallelism.

Paths:
    dcp_lse_combine              kvtide kernel, needs DCP > 1
    fused_add_rmsnorm            kvtide kernel
    kimi_k3_latency_specialized  vLLM's path, switched on by additional_config
"""

from __future__ import annotations

from dataclasses import dataclass

from kernels.scope import COMBINE, RMSNORM, AddRmsNormScope, KernelScope, LseCombineScope

__all__ = [
    "KIMI_K3_ADDITIONAL_CONFIG",
    "KIMI_K3_PATH",
    "PATHS",
    "VALIDATED",
    "EngineShape",
    "PathDecision",
    "ValidatedScope",
    "decide",
    "decision_for",
]

KIMI_K3_PATH = "kimi_k3_latency_specialized"
KIMI_K3_ADDITIONAL_CONFIG = {"decode_backend": "latency_specialized"}
KIMI_K3_MODEL_TYPES = frozenset({"kimi_k3"})
PATHS: tuple[str, ...] = (COMBINE.name, RMSNORM.name, KIMI_K3_PATH)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineShape:
    """What the gate needs to know about one engine (one TP x DCP group of GPUs).

    ``gpu_arch`` is the PTX target of its GPUs ("sm_90a" H100/H200, "sm_100a" B200/GB200,
    "sm_103a" GB300). ``attention_head_dim`` is the head dim of the attention output the
    DCP ranks merge (an MLA model's ``kv_lora_rank``, 512 for DeepSeek V3 and Kimi).
    ``max_batch`` is the engine's largest decode batch (``max_num_seqs``); the norm runs
    on at most that many tokens per decode step.
    """

    gpu_arch: str
    model_type: str
    dtype: str
    hidden_size: int
    num_attention_heads: int
    attention_head_dim: int
    tp: int
    dcp: int = 1
    pp: int = 1
    ep: int = 1
    max_batch: int

    @property
    def combine_heads(self) -> int:
        """Heads per rank in the DCP merge: a TP rank's heads, gathered over DCP ranks."""
        return self.num_attention_heads // self.tp * self.dcp


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidatedScope:
    """A scope, inside a kernel's declared one, that GPU evidence covers.

    ``evidence`` is a path under ``kernels/evidence/``; a test checks that the file exists,
    was recorded on ``scope.archs``, and passed every case of ``scope.cases()``.
    """

    scope: KernelScope
    evidence: str


# Validated scopes, checked in with their evidence. None yet: no GPU run has been made.
VALIDATED: tuple[ValidatedScope, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class PathDecision:
    path: str
    enabled: bool
    reason: str
    evidence: str | None = None


def _combine_refusal(scope: LseCombineScope, e: EngineShape) -> str | None:
    return scope.refuse(
        arch=e.gpu_arch,
        dtype=e.dtype,
        head_dim=e.attention_head_dim,
        num_ranks=e.dcp,
        num_heads=e.combine_heads,
        batch=e.max_batch,
    )


def _rmsnorm_refusal(scope: AddRmsNormScope, e: EngineShape) -> str | None:
    return scope.refuse(
        arch=e.gpu_arch, dtype=e.dtype, hidden_size=e.hidden_size, batch=e.max_batch
    )


def _refusal(scope: KernelScope, e: EngineShape) -> str | None:
    if isinstance(scope, LseCombineScope):
        return _combine_refusal(scope, e)
    return _rmsnorm_refusal(scope, e)


def _kernel_decision(
    declared: KernelScope, e: EngineShape, validated: tuple[ValidatedScope, ...]
) -> PathDecision:
    name = declared.name
    if isinstance(declared, LseCombineScope) and e.dcp <= 1:
        return PathDecision(path=name, enabled=False, reason="DCP is 1: nothing to combine")
    outside = _refusal(declared, e)
    if outside is not None:
        return PathDecision(
            path=name, enabled=False, reason=f"outside the kernel's scope: {outside}"
        )
    candidates = [v for v in validated if v.scope.name == name]
    for entry in candidates:
        if _refusal(entry.scope, e) is None:
            return PathDecision(
                path=name,
                enabled=True,
                reason=f"inside a scope validated by {entry.evidence}",
                evidence=entry.evidence,
            )
    if not candidates:
        return PathDecision(
            path=name,
            enabled=False,
            reason=f"no evidence: no GPU validation of {name} is checked in "
            "(kvtide kernels validate on a GPU, then add it to kernels.gate.VALIDATED)",
        )
    misses = "; ".join(f"{v.evidence}: {_refusal(v.scope, e)}" for v in candidates)
    return PathDecision(
        path=name, enabled=False, reason=f"no evidence covers this engine ({misses})"
    )


def _kimi_k3_decision(e: EngineShape) -> PathDecision:
    def refuse(why: str) -> PathDecision:
        return PathDecision(path=KIMI_K3_PATH, enabled=False, reason=why)

    if e.model_type not in KIMI_K3_MODEL_TYPES:
        return refuse(f"model type {e.model_type!r} is not Kimi K3")
    if e.gpu_arch not in ("sm_100a", "sm_103a"):
        return refuse(f"arch {e.gpu_arch}: vLLM's Kimi K3 path runs only on SM100/SM103")
    if e.tp not in (8, 16):
        return refuse(f"TP {e.tp}: vLLM's Kimi K3 path needs TP 8 or 16")
    if e.dcp not in (1, e.tp):
        return refuse(f"DCP {e.dcp}: vLLM's Kimi K3 path needs DCP 1 or DCP = TP ({e.tp})")
    if e.pp != 1:
        return refuse(f"PP {e.pp}: vLLM's Kimi K3 path refuses pipeline parallelism")
    if e.ep != 1:
        return refuse(f"EP {e.ep}: vLLM's Kimi K3 path refuses expert parallelism")
    return PathDecision(
        path=KIMI_K3_PATH,
        enabled=True,
        reason="inside vLLM's limits (SM100/SM103, TP 8/16, DCP 1 or TP, no PP/EP)",
    )


def decide(
    engine: EngineShape, validated: tuple[ValidatedScope, ...] = VALIDATED
) -> tuple[PathDecision, ...]:
    """One decision per path in ``PATHS``, in that order."""
    return (
        _kernel_decision(COMBINE, engine, validated),
        _kernel_decision(RMSNORM, engine, validated),
        _kimi_k3_decision(engine),
    )


def decision_for(
    path: str, engine: EngineShape, validated: tuple[ValidatedScope, ...] = VALIDATED
) -> PathDecision:
    for decision in decide(engine, validated):
        if decision.path == path:
            return decision
    raise KeyError(f"unknown specialised path {path!r}; known: {list(PATHS)}")
