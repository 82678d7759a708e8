"""``benchmarks/kernels_evidence.sh``: both parts run on CPU in CI (``--dry-run``).

The kernel part needs only what a bare GPU host has, and its engine A/B is a separate
invocation (``--ab``) for a host with vLLM; the dry run runs the kernel part with the
kernels' emulation and prints the A/B's engine plans, so the script's plumbing is
checked without a GPU. A budget of 0 would be ``timeout 0``, no limit at all: refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "kernels_evidence.sh"


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"PYTHON": sys.executable} | env,
    )


def test_dry_run_runs_the_kernel_part_and_the_ab_part_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "ev"
    done = run("--dry-run", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((out / "kernels-cpu.json").read_text())
    assert data["summary"] == {"passed": 20, "failed": 0, "not_run": 0}
    assert "fused_add_rmsnorm" in (out / "show.txt").read_text()
    plan = json.loads((out / "ab-plan.json").read_text())
    assert plan["path"].pop("additional_config") == {"decode_backend": "latency_specialized"}
    assert plan["stock"] == plan["path"]
    self_check = json.loads((out / "ab-self-check-plan.json").read_text())
    assert self_check["stock"] == self_check["path"] and self_check["batches"] == [1, 16, 64]


def test_a_budget_is_never_unbounded(tmp_path: Path) -> None:
    for name in ("KERNELS_BUDGET_S", "AB_BUDGET_S"):
        done = run("--dry-run", str(tmp_path / "ev"), **{name: "0"})
        assert done.returncode == 2
        assert f"{name} must be at least 1 second, got 0" in done.stderr
    done = run("--dry-run", str(tmp_path / "ev"), KERNELS_BUDGET_S="soon")
    assert done.returncode == 2 and "must be a whole number of seconds" in done.stderr
