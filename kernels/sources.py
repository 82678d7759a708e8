"""What binds evidence to the code it measured: digests of the kernel sources and files.

Standard library only (the gate reads ``source_digest()``). The digest covers the CuTe
sources and the variants they are compiled for; ``file_sha256`` is what the cubin
manifest records for each cubin and PTX file, and what evidence files copy.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

__all__ = ["CUTE_DIR", "file_sha256", "source_digest"]

CUTE_DIR = Path(__file__).resolve().parent / "cute"


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@cache
def source_digest() -> str:
    """sha256 over the CuTe sources and the variants of every scope (read once)."""
    from kernels.scope import SCOPES

    h = hashlib.sha256()
    for path in sorted(CUTE_DIR.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    for scope in SCOPES:
        for variant in scope.variants():
            h.update(repr(variant).encode())
    return h.hexdigest()
