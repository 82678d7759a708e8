"""Evidence files the gate accepts, written for tests (nothing is checked in yet).

The gate loads an entry's evidence file on every decision, so a test that needs a path
enabled writes a real file: ``ab_entry`` an A/B of a narrowed ``VllmPathScope`` (every
batch size passed, not slower, the backend ran, the exact vLLM version), and
``kernel_entry`` a validation of a narrowed kernel scope bound to today's shipped
binding of its arch.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kernels import ab, evidence
from kernels.gate import ValidatedScope
from kernels.scope import AddRmsNormScope, VllmPathScope
from kernels.sources import shipped_binding
from kernels.validate import CaseResult

# Module-level entries (made at import) are written here; removed when the tests end.
DIR = Path(tempfile.mkdtemp(prefix="kvtide-test-evidence-"))
atexit.register(shutil.rmtree, DIR, ignore_errors=True)
FINGERPRINT = {"gpu": {"name": "NVIDIA H200"}, "driver": "570.1", "git_commit": "abc"}
STOCK_BUILT = {"additional_config": {}, "modules": ["vllm.Linear", "vllm.MLAAttention"]}
PATH_BUILT = {
    "additional_config": {"decode_backend": "latency_specialized"},
    "modules": ["vllm.Linear", "vllm.MLAAttention", "vllm.kimi_k3.SpecializedDecode"],
}


def _record(tokens: list[int], gap: float) -> ab.RequestRecord:
    return ab.RequestRecord(
        token_ids=tuple(tokens), arrival_s=tuple(0.1 + gap * i for i in range(len(tokens)))
    )


def ab_entry(scope: VllmPathScope, name: str, directory: Path = DIR) -> ValidatedScope:
    """A passing A/B of ``scope`` (one arch, one (TP, DCP), one vLLM) and its entry."""
    (arch,), ((tp, dcp),), (version,) = scope.archs, scope.parallel, scope.vllm_versions
    results = [
        ab.compare(c.batch, [_record([1, 2, 3], 0.010)], [_record([1, 2, 3], 0.008)])
        for c in scope.cases()
    ]
    ab.write(
        directory / Path(name).stem,
        arch=arch,
        engine={"model_type": scope.model_types[0], "tp": tp, "dcp": dcp},
        vllm_version=version,
        fingerprint=FINGERPRINT,
        results=results,
        backend=ab.backend_proof(STOCK_BUILT, PATH_BUILT),
        scope=scope,
    )
    return ValidatedScope(scope=scope, evidence=name, evidence_dir=str(directory))


def kernel_results(scope: AddRmsNormScope, timing: float = 10.0) -> list[CaseResult]:
    return [
        CaseResult(
            case_id=c.case_id,
            kernel=c.kernel,
            passed=True,
            max_steps=0.5,
            allowed_steps=1.0,
            detail="ok",
            kernel_us=timing,
            timings={"kernel": {"median_us": timing}, "vllm": {"median_us": 40.0}},
        )
        for c in scope.cases()
    ]


def kernel_entry(
    scope: AddRmsNormScope,
    name: str,
    directory: Path = DIR,
    binding: dict[str, Any] | None = None,
) -> ValidatedScope:
    """A passing validation of ``scope`` (one arch) bound to ``binding`` (default:
    today's shipped binding of the arch) and its entry."""
    (arch,) = scope.archs
    bound = shipped_binding(arch) if binding is None else binding
    assert bound is not None
    evidence.write(directory / Path(name).stem, arch, kernel_results(scope), {}, FINGERPRINT, bound)
    return ValidatedScope(
        scope=scope,
        evidence=name,
        source_sha256=bound["source_sha256"],
        evidence_dir=str(directory),
    )
