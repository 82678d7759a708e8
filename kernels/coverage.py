"""Whether an evidence file covers a validated scope today. Standard library only.

Evidence is bound to what produced it: a kernel run records a ``binding``
(``kernels.sources``: the kernel sources, the harness and launcher, the launch settings
and the sha256 of every cubin and PTX file of its arch); an A/B run records the vLLM
version, the GPU, the engine's TP/DCP, the batch sizes it measured and proof that the
specialised backend ran. ``stale(data, today)`` says why a kernel evidence file no
longer describes today's code (None: it does); ``covers(entry, data)`` says why a file
does not back a ``kernels.gate.ValidatedScope`` (None: it does); ``check_file(entry)``
loads the entry's file and asks ``covers``: the gate runs it on every decision. Stale
evidence covers nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernels.scope import VllmPathScope
from kernels.sources import EVIDENCE_DIR, shipped_binding

if TYPE_CHECKING:
    from kernels.gate import ValidatedScope

__all__ = ["BOUND", "check_file", "covers", "stale"]

# What a kernel evidence file's binding must match today, and what each one names.
BOUND = {
    "source_sha256": "kernel sources",
    "harness_sha256": "harness and launcher",
    "launch_sha256": "launch settings",
}


def stale(data: Mapping[str, Any], today: Mapping[str, Any] | None) -> str | None:
    """Why kernel evidence ``data`` is stale against ``today``'s binding of its arch
    (``kernels.sources.shipped_binding``; None: no cubins are shipped for the arch)."""
    if today is None:
        return f"no cubins are shipped for {data.get('arch')} (kernels/cubins/manifest.json)"
    binding = data.get("binding") or {}
    for key, what in BOUND.items():
        made = binding.get(key)
        if made != today[key]:
            return f"made from {what} {str(made)[:12]}, today's are {str(today[key])[:12]}"
    recorded = binding.get("files_sha256") or {}
    want = today["files_sha256"]
    changed = sorted(f for f in set(recorded) | set(want) if recorded.get(f) != want.get(f))
    if changed:
        return f"cubin or PTX changed since (or not recorded): {changed}"
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
    today: Mapping[str, Any] | None = None,
) -> str | None:
    """Why ``data`` (a loaded evidence file) does not back ``entry`` today; None if it
    does. ``today``: the binding to hold a kernel file to (default: the shipped one of
    its arch)."""
    scope = entry.scope
    if isinstance(scope, VllmPathScope):
        return _ab_covers(scope, data)
    if data.get("kind") != "kernels":
        return "not a kernel validation"
    if (data.get("arch"),) != scope.archs:
        return f"recorded on {data.get('arch')}, scope claims {list(scope.archs)}"
    if today is None:
        today = shipped_binding(str(data.get("arch")))
    why = stale(data, today)
    if why is not None:
        return f"stale: {why}"
    assert today is not None  # stale() said why otherwise
    if entry.source_sha256 != today["source_sha256"]:
        return (
            f"the entry names sources {str(entry.source_sha256)[:12]}, "
            f"today's are {str(today['source_sha256'])[:12]}"
        )
    passed = {r["case_id"] for r in data.get("results", []) if r["passed"]}
    missing = [c.case_id for c in scope.cases() if c.case_id not in passed]
    if missing:
        return f"lacks passing {missing[:3]}"
    return None


def check_file(entry: ValidatedScope) -> str | None:
    """Why ``entry``'s evidence file (under ``entry.evidence_dir``, default
    ``kernels/evidence/``) does not back it today; None if it does."""
    path = Path(entry.evidence_dir or EVIDENCE_DIR) / entry.evidence
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return f"cannot read {path.name}: {exc}"
    if not isinstance(data, dict):
        return f"{path.name} is not an evidence file"
    return covers(entry, data)
