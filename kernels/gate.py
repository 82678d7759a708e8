"""Whether an engine may use each specialised decode path, and why. Pure.

``decide(engine, opted_in=...)`` returns one ``PathDecision`` per path. A path is enabled
only when all of these hold, checked in this order (the reason names the first that
fails):

1. the engine is inside the path's declared scope (``kernels.scope``: a kvtide kernel's
   dtypes and dimensions; for vLLM's Kimi K3 path, vLLM's own limits and versions);
2. a checked-in validated scope (``VALIDATED``: a scope narrowed to what a GPU run
   passed, and the evidence file under ``kernels/evidence/`` that shows it) covers the
   engine: GPU arch, TP/DCP, batch range, and for vLLM's path the vLLM version;
3. that evidence is not stale: a kvtide kernel's evidence was made from today's kernel
   sources (``source_sha256``, compared with ``kernels.sources.source_digest()``);
4. the evidence file itself backs the entry today (``kernels.coverage.check_file``, run
   on every decision): its arch, binding (sources, harness, launch settings, every
   cubin and PTX hash) and every case of the scope passed; for vLLM's path the exact
   vLLM version, TP/DCP, every batch size passed, not slower, and the backend ran;
5. the config opted in to the path (``opted_in``; the plugin counts a path named in its
   environment as opted in).

With ``VALIDATED`` empty (no GPU evidence yet) every path is refused with a reason that
starts "no evidence", wherever it runs and whatever the config asks.

Paths:
    fused_add_rmsnorm            kvtide kernel
    kimi_k3_latency_specialized  vLLM's path, switched on by additional_config
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from kernels.coverage import check_file
from kernels.scope import KIMI_K3, RMSNORM, AddRmsNormScope, VllmPathScope
from kernels.sources import source_digest

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

KIMI_K3_PATH = KIMI_K3.name
KIMI_K3_ADDITIONAL_CONFIG = dict(KIMI_K3.additional_config)
PATHS: tuple[str, ...] = (RMSNORM.name, KIMI_K3_PATH)

PathScope = AddRmsNormScope | VllmPathScope


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineShape:
    """What the gate needs to know about one engine (one TP x DCP group of GPUs).

    ``gpu_arch`` is the PTX target of its GPUs ("sm_90a" H100/H200, "sm_100a" B200/GB200,
    "sm_103a" GB300). ``attention_head_dim`` is the head dim of the attention output (an
    MLA model's ``kv_lora_rank``). ``max_batch`` is the engine's largest decode batch
    (``max_num_seqs``). ``vllm_version`` is the vLLM the engine runs (None: unknown,
    which vLLM's paths refuse).
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
    vllm_version: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidatedScope:
    """A scope, inside a path's declared one, that GPU evidence covers.

    ``evidence`` is a file name under ``evidence_dir`` (None: ``kernels/evidence/``);
    ``source_sha256`` the kernel source digest that evidence was made from (None for
    vLLM's paths, whose scope names the exact vLLM versions instead). The gate loads the
    file on every decision and refuses the entry unless it covers the scope today
    (``kernels.coverage.check_file``).
    """

    scope: PathScope
    evidence: str
    source_sha256: str | None = None
    evidence_dir: str | None = None


# Validated scopes, checked in with their evidence. None yet: no GPU run has been made.
VALIDATED: tuple[ValidatedScope, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class PathDecision:
    path: str
    enabled: bool
    reason: str
    evidence: str | None = None


def _refusal(scope: PathScope, e: EngineShape) -> str | None:
    if isinstance(scope, VllmPathScope):
        return scope.refuse(
            model_type=e.model_type,
            arch=e.gpu_arch,
            tp=e.tp,
            dcp=e.dcp,
            pp=e.pp,
            ep=e.ep,
            batch=e.max_batch,
            vllm_version=e.vllm_version,
        )
    return scope.refuse(
        arch=e.gpu_arch, dtype=e.dtype, hidden_size=e.hidden_size, batch=e.max_batch
    )


def _stale(entry: ValidatedScope, sources: str) -> str | None:
    if isinstance(entry.scope, VllmPathScope) or entry.source_sha256 == sources:
        return None
    made = (entry.source_sha256 or "unrecorded")[:12]
    return (
        f"stale evidence: {entry.evidence} was made from kernel sources {made}, "
        f"these are {sources[:12]} (validate again)"
    )


def _decision(
    declared: PathScope,
    e: EngineShape,
    validated: tuple[ValidatedScope, ...],
    opted_in: Collection[str],
    sources: str,
) -> PathDecision:
    name = declared.name

    def off(reason: str) -> PathDecision:
        return PathDecision(path=name, enabled=False, reason=reason)

    outside = _refusal(declared, e)
    if outside is not None:
        owner = "vLLM's limits" if isinstance(declared, VllmPathScope) else "the kernel's scope"
        return off(f"outside {owner}: {outside}")
    candidates = [v for v in validated if v.scope.name == name]
    if not candidates:
        return off(
            f"no evidence: no GPU validation of {name} is checked in (kvtide kernels "
            "validate / kvtide kernels ab on a GPU, then add it to kernels.gate.VALIDATED)"
        )
    covering = [v for v in candidates if _refusal(v.scope, e) is None]
    if not covering:
        misses = "; ".join(f"{v.evidence}: {_refusal(v.scope, e)}" for v in candidates)
        return off(f"no evidence covers this engine ({misses})")
    fresh = [v for v in covering if _stale(v, sources) is None]
    if not fresh:
        return off("; ".join(str(_stale(v, sources)) for v in covering))
    backed = [v for v in fresh if check_file(v) is None]
    if not backed:
        misses = "; ".join(f"{v.evidence}: {check_file(v)}" for v in fresh)
        return off(f"evidence does not back the scope ({misses})")
    entry = backed[0]
    if name not in opted_in:
        return off(
            f"not opted in: {entry.evidence} covers this engine, but the config's "
            "specialised_paths does not name it"
        )
    return PathDecision(
        path=name,
        enabled=True,
        reason=f"opted in, inside a scope validated by {entry.evidence}",
        evidence=entry.evidence,
    )


def decide(
    engine: EngineShape,
    validated: tuple[ValidatedScope, ...] = VALIDATED,
    opted_in: Collection[str] = (),
    sources: str | None = None,
) -> tuple[PathDecision, ...]:
    """One decision per path in ``PATHS``, in that order. ``sources`` is today's kernel
    source digest (default: ``kernels.sources.source_digest()``)."""
    today = source_digest() if sources is None else sources
    return tuple(
        _decision(scope, engine, validated, opted_in, today) for scope in (RMSNORM, KIMI_K3)
    )


def decision_for(
    path: str,
    engine: EngineShape,
    validated: tuple[ValidatedScope, ...] = VALIDATED,
    opted_in: Collection[str] = (),
    sources: str | None = None,
) -> PathDecision:
    for decision in decide(engine, validated, opted_in, sources):
        if decision.path == path:
            return decision
    raise KeyError(f"unknown specialised path {path!r}; known: {list(PATHS)}")
