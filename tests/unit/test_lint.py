"""The linters and the layering contracts run with the tests (so CI runs them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    "command",
    [
        [str(BIN / "ruff"), "check", "."],
        [str(BIN / "ruff"), "format", "--check", "."],
        [str(BIN / "mypy")],  # strict, on the files pyproject.toml lists
        [str(BIN / "lint-imports")],  # [tool.importlinter] contracts in pyproject.toml
    ],
    ids=["ruff-check", "ruff-format", "mypy", "import-linter"],
)
def test_the_tree_is_clean(command: list[str]) -> None:
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{' '.join(command[:2])} failed:\n{out.stdout}\n{out.stderr}"
