"""Run a snippet in a fresh interpreter, from the repository root.

The tests that check what importing kvtide pulls in (torch, vLLM, Ray, the OpenTelemetry
SDK) need an interpreter into which no other test has imported anything.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def printed_by_fresh_python(code: str) -> list[str]:
    """The words ``python -c code`` prints in a new process started at the repository
    root (so it imports this checkout); raises ``CalledProcessError`` if it fails."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    return out.stdout.split()
