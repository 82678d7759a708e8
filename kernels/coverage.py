"""Whether an evidence file covers a validated scope today. Standard library only.

Evidence is bound to what produced it: a kernel run records the kernel source digest and
the sha256 of every cubin and PTX file it could have launched (``binding``); an A/B run
records the vLLM version, the GPU, the engine's TP/DCP and the batch sizes it measured.
``stale(data, ...)`` says why a kernel evidence file no longer describes today's code
(None: it does); ``covers(entry, data, ...)`` says why a file does not back a
``kernels.gate.ValidatedScope`` (None: it does). Stale evidence covers nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kernels.gate import ValidatedScope
from kernels.scope import VllmPathScope

__all__ = ["covers", "stale"]


def stale(data: Mapping[str, Any], sources: str, cubin_hashes: Mapping[str, str]) -> str | None:
    """Why kernel evidence ``data`` is stale against today's ``sources`` digest and the
    manifest's ``cubin_hashes`` (``{file: sha256}`` for its arch); None when current."""
    binding = data.get("binding") or {}
    made = binding.get("source_sha256")
    if made != sources:
        return f"made from kernel sources {str(made)[:12]}, today's are {sources[:12]}"
    recorded = binding.get("files_sha256") or {}
    if not recorded:
        return "records no cubin or PTX hashes"
    changed = sorted(f for f, h in recorded.items() if cubin_hashes.get(f) != h)
    if changed:
        return f"cubin or PTX changed since: {changed}"
    return None


def _ab_covers(scope: VllmPathScope, data: Mapping[str, Any]) -> str | None:
    engine = data.get("engine") or {}
    if data.get("kind") != "ab" or data.get("path") != scope.name:
        return f"not an A/B of {scope.name}"
    if (data.get("arch"),) != scope.archs:
        return f"recorded on {data.get('arch')}, scope claims {list(scope.archs)}"
    if [(engine.get("tp"), engine.get("dcp"))] != [tuple(p) for p in scope.parallel]:
        return f"TP/DCP {engine.get('tp')}/{engine.get('dcp')}, scope claims {scope.parallel}"
    if engine.get("model_type") not in scope.model_types:
        return f"model type {engine.get('model_type')!r} not in {list(scope.model_types)}"
    version = str(data.get("vllm_version"))
    if list(scope.vllm_versions) != [version]:
        # Exact: evidence from 0.33.0 says nothing about 0.33.1.
        return f"vLLM {version}, scope claims {list(scope.vllm_versions)}"
    if not (data.get("backend") or {}).get("ran"):
        return "no proof that the specialised backend ran (backend.ran)"
    rows = {r["batch"]: r for r in data.get("results", [])}
    for case in scope.cases():
        row = rows.get(case.batch)
        if row is None or not row.get("passed"):
            return f"no passing A/B at batch {case.batch}"
        if not row.get("speed_judged") or not row.get("not_slower"):
            return f"batch {case.batch}: the path's ITL is not judged at most the stock path's"
    return None


def covers(
    entry: ValidatedScope,
    data: Mapping[str, Any],
    sources: str,
    cubin_hashes: Mapping[str, str],
) -> str | None:
    """Why ``data`` (a loaded evidence file) does not back ``entry`` today; None if it does."""
    scope = entry.scope
    if isinstance(scope, VllmPathScope):
        return _ab_covers(scope, data)
    if data.get("kind") != "kernels":
        return "not a kernel validation"
    if (data.get("arch"),) != scope.archs:
        return f"recorded on {data.get('arch')}, scope claims {list(scope.archs)}"
    why = stale(data, sources, cubin_hashes)
    if why is not None:
        return f"stale: {why}"
    if entry.source_sha256 != sources:
        return (
            f"the entry names sources {str(entry.source_sha256)[:12]}, today's are {sources[:12]}"
        )
    passed = {r["case_id"] for r in data.get("results", []) if r["passed"]}
    missing = [c.case_id for c in scope.cases() if c.case_id not in passed]
    if missing:
        return f"lacks passing {missing[:3]}"
    return None
