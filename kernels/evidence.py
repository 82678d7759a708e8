"""Evidence files: what a validation run saw, where, and on what software.

An evidence file is JSON (``<name>.json``) with a Markdown twin (``<name>.md``) for
people. JSON fields:

    format        1
    created_utc   ISO 8601
    arch          PTX target of the GPU ("sm_90a")
    fingerprint   GPU, driver, CUDA, package versions, git commit (``fingerprint()``)
    cubins        where the kernels came from: directory, source digest, DSL version,
                  launch backend, cubin or PTX
    results       one ``CaseResult`` per case
    summary       {"passed": n, "failed": m}

``show()`` lists every scope and, per arch, how many of its cases have passing evidence
under ``kernels/evidence/``; ``diff()`` compares two evidence files.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import subprocess
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kernels.gate import VALIDATED
from kernels.scope import SCOPES

__all__ = ["EVIDENCE_DIR", "diff", "fingerprint", "load", "show", "write"]

EVIDENCE_DIR = Path(__file__).resolve().parent / "evidence"
REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("torch", "nvidia-cutlass-dsl", "cuda-bindings", "cupy-cuda12x", "cupy-cuda13x", "vllm")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def fingerprint() -> dict[str, Any]:
    """GPU, driver, CUDA, package versions and the git commit of this checkout."""
    import torch

    gpu: dict[str, Any] = {"available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu.update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            sm_count=props.multi_processor_count,
            count=torch.cuda.device_count(),
        )
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    status = _run(["git", "status", "--porcelain"], cwd=REPO)
    return {
        "gpu": gpu,
        "driver": smi.splitlines()[0] if smi else None,
        "cuda_torch": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES},
        "git_commit": _run(["git", "rev-parse", "HEAD"], cwd=REPO),
        "git_dirty": None if status is None else bool(status),
    }


def write(
    path_stem: Path,
    arch: str,
    results: list[Any],
    cubins: dict[str, Any],
    fp: dict[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Write ``<stem>.json`` and ``<stem>.md``; ``results`` are ``CaseResult``s."""
    rows = [r.to_json() if hasattr(r, "to_json") else asdict(r) for r in results]
    passed = sum(1 for r in rows if r["passed"])
    data = {
        "format": 1,
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "arch": arch,
        "fingerprint": fp if fp is not None else fingerprint(),
        "cubins": cubins,
        "results": rows,
        "summary": {"passed": passed, "failed": len(rows) - passed},
    }
    path_stem.parent.mkdir(parents=True, exist_ok=True)
    json_path = path_stem.with_suffix(".json")
    md_path = path_stem.with_suffix(".md")
    json_path.write_text(json.dumps(data, indent=1) + "\n")
    md_path.write_text(_markdown(data))
    return json_path, md_path


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _markdown(data: dict[str, Any]) -> str:
    fp = data["fingerprint"]
    gpu = fp.get("gpu", {})
    lines = [
        f"# Kernel evidence: {data['arch']} ({gpu.get('name', 'no GPU')})",
        "",
        f"- created: {data['created_utc']}",
        f"- driver {fp.get('driver')}, CUDA (torch) {fp.get('cuda_torch')}, "
        f"git {fp.get('git_commit')}{' (dirty)' if fp.get('git_dirty') else ''}",
        f"- packages: {', '.join(f'{k} {v}' for k, v in fp.get('packages', {}).items() if v)}",
        f"- cubins: {json.dumps(data['cubins'], sort_keys=True)}",
        f"- passed {data['summary']['passed']}, failed {data['summary']['failed']}",
        "",
        "| case | result | max abs err | kernel µs | stock µs | speed-up |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in data["results"]:
        ratio = "-"
        if r.get("kernel_us") and r.get("stock_us"):
            ratio = f"{r['stock_us'] / r['kernel_us']:.2f}x"
        result = "pass" if r["passed"] else r["detail"]
        lines.append(
            f"| {r['case_id']} | {result} | {r['max_abs_err']:.3g} | {_us(r.get('kernel_us'))} "
            f"| {_us(r.get('stock_us'))} | {ratio} |"
        )
    return "\n".join(lines) + "\n"


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    if data.get("format") != 1:
        raise ValueError(f"{path}: not a kvtide kernel evidence file (format 1)")
    return data


def diff(a: Path, b: Path) -> str:
    """What changed from evidence ``a`` to ``b``: environment, pass/fail, timings."""
    da, db = load(a), load(b)
    lines = [f"--- {a}", f"+++ {b}"]
    for key in ("arch",):
        if da[key] != db[key]:
            lines.append(f"{key}: {da[key]} -> {db[key]}")
    fa, fb = da["fingerprint"], db["fingerprint"]
    for key in sorted(set(fa) | set(fb)):
        if fa.get(key) != fb.get(key):
            lines.append(f"fingerprint.{key}: {fa.get(key)} -> {fb.get(key)}")
    ra = {r["case_id"]: r for r in da["results"]}
    rb = {r["case_id"]: r for r in db["results"]}
    for case_id in sorted(set(ra) - set(rb)):
        lines.append(f"only in a: {case_id}")
    for case_id in sorted(set(rb) - set(ra)):
        lines.append(f"only in b: {case_id}")
    for case_id in sorted(set(ra) & set(rb)):
        x, y = ra[case_id], rb[case_id]
        if x["passed"] != y["passed"]:
            was, now = ("pass" if x["passed"] else "FAIL"), ("pass" if y["passed"] else "FAIL")
            lines.append(f"{case_id}: {was} -> {now} ({y['detail']})")
        if x.get("kernel_us") and y.get("kernel_us"):
            change = y["kernel_us"] / x["kernel_us"] - 1
            if abs(change) >= 0.05:
                lines.append(
                    f"{case_id}: kernel {x['kernel_us']:.1f} -> {y['kernel_us']:.1f} µs "
                    f"({change:+.0%})"
                )
    if len(lines) == 2:
        lines.append("no differences (timings within 5%)")
    return "\n".join(lines)


def _passing_cases(evidence_dir: Path) -> dict[str, dict[str, str]]:
    """arch → {case_id: evidence file name} for every passing case on record."""
    found: dict[str, dict[str, str]] = {}
    for path in sorted(evidence_dir.glob("*.json")):
        try:
            data = load(path)
        except (ValueError, json.JSONDecodeError, KeyError):
            continue
        per_arch = found.setdefault(data["arch"], {})
        for r in data["results"]:
            if r["passed"]:
                per_arch.setdefault(r["case_id"], path.name)
    return found


def show(evidence_dir: Path = EVIDENCE_DIR, cases: bool = False) -> str:
    """Every scope, and per arch whether its cases have passing evidence (``cases``: each
    case on its own line, with the file that passed it)."""
    passing = _passing_cases(evidence_dir)
    lines = []
    for scope in SCOPES:
        fields = {k: v for k, v in asdict(scope).items() if k not in ("name", "archs")}
        lines.append(f"{scope.name}: {', '.join(f'{k}={v}' for k, v in fields.items())}")
        cases_ids = [c.case_id for c in scope.cases()]
        for arch in scope.archs:
            have = passing.get(arch, {})
            covered = [c for c in cases_ids if c in have]
            if not covered:
                status = "unvalidated"
            else:
                files = sorted({have[c] for c in covered})
                kind = "all" if len(covered) == len(cases_ids) else "partial"
                status = f"{kind}: {len(covered)}/{len(cases_ids)} cases pass in {', '.join(files)}"
            lines.append(f"  {arch:<8} {status}")
            if cases:
                lines += [f"    {c}  {have.get(c, 'unvalidated')}" for c in sorted(cases_ids)]
        gated = [v.evidence for v in VALIDATED if v.scope.name == scope.name]
        lines.append(
            f"  enabled by the gate: {', '.join(gated) if gated else 'nowhere (no evidence)'}"
        )
    return "\n".join(lines)
